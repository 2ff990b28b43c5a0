# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv on demand.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first, pinned to the CPU build that lies on this kind of machine's disk; a bare `torch` would pull a CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test venv clean-venv

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(BIN)/.installed

# The ledger suite runs on SQLite and on PostgreSQL: tests/postgres_server.sh installs and starts a local server when
# it can and prints its URL (or says, on one line, why the PostgreSQL tests will be skipped). REQUIRE_POSTGRES=1 (CI)
# turns "skipped" into an error, there and in pytest.
REQUIRE_POSTGRES ?=
export REQUIRE_POSTGRES

test: venv
	url=$$(bash tests/postgres_server.sh) && \
	PREREG_TEST_POSTGRES_URL="$$url" $(BIN)/python -m pytest -n 2 --dist loadgroup tests

demo: venv
	PREREG_DEMO=1 $(BIN)/python -m engine.demo

clean-venv:
	rm -rf $(VENV)
