# The two commands a newcomer needs: `make train` and `make test`. Both create the environment first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stalwart-installed
TEST_STAMP := $(VENV)/.stalwart-test-installed
export OMP_NUM_THREADS ?= 1

.PHONY: env train test bench clean-env

# The runtime environment: torch (reused if importable, else pinned torch==2.13.0) + Stalwart.
$(STAMP): pyproject.toml scripts/bootstrap.py
	$(PYTHON) scripts/bootstrap.py --venv $(VENV) --extras ""
	@touch $@

# Test-only extras (pytest, transformers, selenium, tensorboard) on top.
$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install --disable-pip-version-check -q -e '.[test]'
	@touch $@

env: $(STAMP)

## Train the default model on the bundled corpus (the Python standard library) with 2 processes.
train: $(STAMP)
	$(BIN)/stalwart train --config default

## Run the whole test suite (what CI runs).
test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q tests

## Throughput benchmark (reference workload, 1 and 2 processes).
bench: $(STAMP)
	$(BIN)/stalwart bench throughput

clean-env:
	rm -rf $(VENV)
