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
	# Two processes (each test file stays on one), then the tests that time things, alone:
	# most tests wait on child processes and sockets, so two at once halve the wall time.
	$(BIN)/pytest -q -rs -n 2 --dist loadfile -m "not timing"
	$(BIN)/pytest -q -rs -m timing

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
