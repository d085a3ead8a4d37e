# Two commands do everything on a fresh Debian machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/install-system-deps.sh
	SPOKEFS_PEERS=1 ./scripts/install-system-deps.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench,torch]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/spokefs demo

test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/pytest -q -rs

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
