# The two commands a newcomer needs: `make train` and `make test`. Both create the environment first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stalwart-installed
TEST_STAMP := $(VENV)/.stalwart-test-installed
export OMP_NUM_THREADS ?= 1

.PHONY: env train test test-fast test-multiproc test-e2e test-gpu bench clean-env

# The runtime environment: torch (reused if importable, else pinned torch==2.13.0) + Stalwart.
$(STAMP): pyproject.toml scripts/bootstrap.py
	$(PYTHON) scripts/bootstrap.py --venv $(VENV) --extras ""
	@touch $@

# Test-only extras (pytest, transformers, selenium, tensorboard) and the controller's Monarch on top.
$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install --disable-pip-version-check -q -e '.[test,controller]'
	@touch $@

env: $(STAMP)

## Train the default model on the bundled corpus (the Python standard library) with 2 processes.
train: $(STAMP)
	$(BIN)/stalwart train --config default

## Run the whole test suite (what CI runs): all three tiers, on TEST_WORKERS pytest-xdist workers
## (2 by default, the CI machine's cores; a fixed number, since a container's CPU count can overstate
## its share).
TEST_WORKERS ?= 2
test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) tests

## The fast tier: pure-logic unit tests, under two minutes. Run it on every change.
test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q tests -m unit

## Multi-process tests on gloo (spawned workers), without the CLI.
test-multiproc: $(TEST_STAMP)
	$(BIN)/python -m pytest -q tests -m multiproc

## End-to-end tests through the real CLI (and the browser, network namespaces).
test-e2e: $(TEST_STAMP)
	$(BIN)/python -m pytest -q tests -m e2e

## The GPU tier: training, FSDP over NCCL, serving, RL and weight sync on CUDA. Every test is skipped,
## with the reason shown, on a machine without CUDA; figures are appended to gpu-figures.jsonl.
test-gpu: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -rs -s tests -m gpu

## Throughput benchmark (reference workload, 1 and 2 processes).
bench: $(STAMP)
	$(BIN)/stalwart bench throughput

clean-env:
	rm -rf $(VENV)
