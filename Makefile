# Set-up is part of every target: the virtual environment is created on first use, with torch
# pinned (an unpinned torch would pull a multi-GB CUDA build).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.cloudburst-installed
TORCH  := torch==2.13.0

.PHONY: demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

## The main job: sync vs asgd on MNIST-1D, a comparison table and runs/demo/curves.png
demo: $(STAMP)
	$(BIN)/python -m cloudburst demo --out runs/demo

## The whole test suite (unit, distributed, end-to-end) and the linter
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	OMP_NUM_THREADS=1 $(BIN)/pytest -q

## The inner loop: the unit tests only (no processes, comm faked; under a minute on 2 cores)
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -m "unit and not spawns" tests/unit

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) runs .pytest_cache
