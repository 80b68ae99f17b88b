#!/usr/bin/env bash
# Short GPU check (for a machine with one CUDA device): the bf16 policy, engine and
# trainer paths on the GPU, end to end, in a few minutes. Not part of `make test`.
#   bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
make setup >/dev/null
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
out=$(mktemp -d)
# tiny model, bf16 on cuda (dtype auto), 3 steps: the run folder contract must hold
.venv/bin/looprl run --set model.name=tiny-random --set model.device=cuda --set train.steps=3 \
  --set rollout.tasks_per_step=4 --set eval.tasks=8 --out "$out/tiny" --force
# the default model on the GPU for 3 steps: logprob parity between engine and trainer
.venv/bin/looprl run --set model.device=cuda --set train.steps=3 --set eval.tasks=16 \
  --out "$out/smollm2" --force
.venv/bin/python - "$out" <<'PY'
import json, sys
for name in ("tiny", "smollm2"):
    rows = [json.loads(l) for l in open(f"{sys.argv[1]}/{name}/metrics.jsonl")]
    gap = max(r["rollout/logprob_gap"] for r in rows)
    step_s = sum(r["perf/step_s"] for r in rows) / len(rows)
    print(f"RESULT run={name} logprob_gap_max={gap:.2e} step_s={step_s:.2f}")
    assert gap < 5e-2, "engine and trainer logprobs disagree on the GPU (bf16)"
PY
