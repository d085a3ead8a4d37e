# Two commands do everything on a fresh Debian machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The native core (native/: Rust, and the C of its vendored libxxhash): the editable install
# builds it into spokefs/_native*.so, and only then, so a change to any of these files
# reinstalls (rebuilds) it.
NATIVE_SRC := $(shell find native -path native/target -prune -o \( -name '*.rs' \
                -o -name Cargo.toml -o -name Cargo.lock -o -name '*.[ch]' \) -type f -print)
# cargo in native/, against the venv's Python (pyo3's build configuration), with the
# committed Cargo.lock.
CARGO := cd native && PYO3_PYTHON=$(abspath $(BIN)/python) cargo

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/install-system-deps.sh $(NATIVE_SRC)
	SPOKEFS_PEERS=1 ./scripts/install-system-deps.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench,torch]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/spokefs demo

# Every peer the benchmarks compare with (a missing one fails them, docs/race.md): rclone, a
# Debian package, and fsspec's HTTP filesystem (fsspec and aiohttp, spokefs's own dependencies).
.PHONY: bench-deps
bench-deps: $(STAMP)
	SPOKEFS_PEERS=1 ./scripts/install-system-deps.sh
	$(BIN)/python -c "import aiohttp, fsspec"

test: $(STAMP)
	$(BIN)/ruff check src tests
	$(CARGO) test --workspace --locked
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings
	# Two processes (each test file stays on one), then the tests that time things, alone:
	# most tests wait on child processes and sockets, so two at once halve the wall time.
	$(BIN)/pytest -q -rs -n 2 --dist loadfile -m "not timing"
	$(BIN)/pytest -q -rs -m timing

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(CARGO) fmt --check

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache native/target src/spokefs/_native*.so
