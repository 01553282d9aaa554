# The two commands of a fresh clone (README, "The two commands"): `make run` and `make test`.
# torch is installed first and pinned: an unpinned torch pulls several GB of CUDA wheels.
# On a CUDA machine: make TORCH=torch==2.13.0 (or the build you need) run
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.moeflow-installed

.PHONY: run test lint install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev,hf]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/moeflow train --config configs/tiny.toml --nproc 2 --out runs/default $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) runs .pytest_cache
