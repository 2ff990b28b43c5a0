# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv on demand.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first, pinned to the CPU build that lies on this kind of machine's disk; a bare `torch` would pull a CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo demo-command test venv clean-venv

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

# The launcher suite submits jobs to a one-node Slurm cluster on this machine: tests/slurm_cluster.sh installs and
# starts it when it can and prints its partition (or says, on one line, why the Slurm tests will be skipped).
# REQUIRE_SLURM=1 (CI) turns "skipped" into an error, there and in pytest.
REQUIRE_SLURM ?=
export REQUIRE_SLURM

# ruff first: lint and format at 120 columns (pyproject.toml) are part of the suite. Then the whole suite on both
# cores; the cluster's tests are one xdist group (tests/test_slurm.py), so one job at a time has the other core.
test: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	url=$$(bash tests/postgres_server.sh) && \
	partition=$$(bash tests/slurm_cluster.sh) && \
	export PREREG_TEST_POSTGRES_URL="$$url" PREREG_TEST_SLURM_PARTITION="$$partition" && \
	$(BIN)/python -m pytest -n 2 --dist loadgroup tests

demo: venv
	PREREG_DEMO=1 $(BIN)/python -m engine.demo

# The command workload on a script of its own (examples/command): frozen into a ledger of its own under
# reports/demo-command/ (never ledger.db), run, decided and audited. The example's `python` is the venv's.
DEMO_COMMAND := reports/demo-command
EXAMPLE := examples/command/mlp-matmul.toml
PREREG_IN_VENV := PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python cli.py

demo-command: venv
	rm -rf $(DEMO_COMMAND) && mkdir -p $(DEMO_COMMAND)
	$(PREREG_IN_VENV) check $(EXAMPLE)
	$(PREREG_IN_VENV) freeze $(EXAMPLE) --ledger $(DEMO_COMMAND)/ledger.db
	$(PREREG_IN_VENV) run example-mlp-matmul --file $(EXAMPLE) --ledger $(DEMO_COMMAND)/ledger.db
	$(PREREG_IN_VENV) verdict example-mlp-matmul --ledger $(DEMO_COMMAND)/ledger.db
	$(PREREG_IN_VENV) audit show example-mlp-matmul --ledger $(DEMO_COMMAND)/ledger.db
	$(PREREG_IN_VENV) audit verify --ledger $(DEMO_COMMAND)/ledger.db

clean-venv:
	rm -rf $(VENV)
