#!/usr/bin/env bash
# The GPU check and yardstick, for a machine with one CUDA device, sized to finish within
# eight minutes on one H100 or H200 (estimated from the earlier H200 check's timings, not
# yet timed; its last line, gpu_check_wall_s, says). Not part of `make test`.
#   bash bench/checks/gpu_check.sh
# It checks the bf16 policy, engine and trainer paths on the GPU (a one-GPU torchrun job,
# cascade attention and packing against plain SDPA, the sampler's batch invariance), then
# runs bench/checks/gpu_yardstick.py: the engine against `generate`, the update's speed
# and peak memory against `looprl plan`, a 3-step run, and one full fine-tuning update of
# SmolLM2-135M through `train.shard: fsdp`'s FSDP2 units on this one GPU (bf16 compute,
# float32 reduction: `fsdp_step_s`, `fsdp_peak_gb`); its last line is the summary
# `RESULT device=... engine_vs_generate_b8=... ...` to record in docs/performance.md.
# On a machine without a package index (an air-gapped GPU node):
#   PYTHON=python3    that interpreter (its CUDA torch) instead of `make setup`'s .venv,
#                     looprl importable from this checkout
#   WHEELS=DIR        the wheels in DIR installed first, from DIR alone (gpu_wheels.sh
#                     says which; nothing is downloaded)
#   SMOLLM2_DIR=DIR   SmolLM2-135M's converted folder (a copy of ~/.cache/looprl/smollm2-135m:
#                     config, safetensors, tokenizer) where this machine's cache lacks it
# VLLM=1 adds the vLLM runs and the overlapped-rollouts benchmark on the vllm engine
# (minutes more; `make setup-vllm` needs an index). GPU_CHECK_OUT=DIR keeps the run folders.
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM=${VLLM:-0}
if [ -n "${PYTHON:-}" ]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  PYTHON="$PYTHON" bash bench/checks/gpu_wheels.sh
  py=("$PYTHON"); looprl=("$PYTHON" -m looprl); torchrun=("$PYTHON" -m torch.distributed.run)
else
  make setup >/dev/null
  py=(.venv/bin/python); looprl=(.venv/bin/looprl); torchrun=(.venv/bin/torchrun)
fi
if [ -n "${SMOLLM2_DIR:-}" ]; then
  # a model cache of its own whose two SmolLM2 entries are SMOLLM2_DIR's files (linked)
  cache=$(mktemp -d)
  for entry in smollm2-135m smollm2-135m-tokenizer; do
    mkdir -p "$cache/$entry"
    ln -s "$(realpath "$SMOLLM2_DIR")"/* "$cache/$entry/"
    touch "$cache/$entry/.complete"
  done
  export LOOPRL_CACHE=$cache
fi
"${py[@]}" -c "from looprl.model.load import resolve; resolve('smollm2-135m')" \
  || { echo "no smollm2-135m here: set SMOLLM2_DIR to its converted folder" >&2; exit 1; }
"${py[@]}" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
out=${GPU_CHECK_OUT:-$(mktemp -d)}  # GPU_CHECK_OUT keeps the run folders where you say
mkdir -p "$out"
# one GPU through torchrun (NCCL, one rank), tiny model in bf16: the multi-process path and
# the run folder's contract end to end (the default model's 3-step run is the yardstick's)
"${torchrun[@]}" --nproc_per_node 1 -m looprl run --set model.name=tiny-random \
  --set model.device=cuda --set train.steps=2 --set rollout.tasks_per_step=4 \
  --set eval.tasks=8 --out "$out/torchrun" --force
test -s "$out/torchrun/metrics.jsonl" && echo "RESULT torchrun_1gpu=ok"
# cascade attention on the GPU: the trainer's logprobs with and without it (float32:
# equal; bfloat16: no further from the float32 reference than plain SDPA's), and with
# its suffixes packed and padded
"${py[@]}" - <<'PY'
import torch
from looprl.chat import ChatRenderer
from looprl.engine import GenerationRequest, SamplingParams
from looprl.engine.hf import HFEngine
from looprl.envs import make_env
from looprl.model.load import load_causal_lm, load_tokenizer
from looprl.forward.score import sequence_logprobs

tok = load_tokenizer("smollm2-135m")
renderer = ChatRenderer(tok, model_name="smollm2-135m")
env = make_env("tictactoe-move", {"tool_choice": "auto"})
prompts = []
for task in env.tasks("train", n=8, seed=3):
    obs = env.reset(task)
    prompts.append(renderer.prompt_ids(obs.messages, obs.tools))
cuda = torch.device("cuda")
reference = None
for dtype in (torch.float32, torch.bfloat16):
    model = load_causal_lm("smollm2-135m", dtype).to(cuda).eval()
    engine = HFEngine(model, tok, renderer.eos_ids)
    assert engine.cascade, "cascade attention is off on CUDA"
    if reference is None:
        reqs = [GenerationRequest(p) for p in prompts for _ in range(4)]
        outs = engine.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=32, seed=1))
        seqs = [r.prompt_ids + o.ids for r, o in zip(reqs, outs)]
        masks = [[0] * len(r.prompt_ids) + [1] * len(o.ids) for r, o in zip(reqs, outs)]
        sampled = torch.tensor([lp for o in outs for lp in o.logprobs], device=cuda)
    with torch.no_grad():
        ours, mask = sequence_logprobs(model, seqs, masks, 0, cuda, 1.0)  # packed suffixes
        padded, _ = sequence_logprobs(model, seqs, masks, 0, cuda, 1.0, pack=False)
        packing_gap = (ours.float() - padded.float())[mask].abs().max().item()
        print(f"RESULT {dtype} packed_vs_padded={packing_gap:.2e}")
        assert packing_gap < (1e-4 if dtype == torch.float32 else 5e-2)
        model.set_attn_implementation("sdpa")
        plain, _ = sequence_logprobs(model, seqs, masks, 0, cuda, 1.0)
    ours, plain = ours.float()[mask], plain.float()[mask]
    if reference is None:
        reference = plain
        engine_gap = (sampled - ours).abs().mean().item()
        print(f"RESULT cascade_fp32_vs_sdpa={(ours - plain).abs().max().item():.2e} "
              f"engine_vs_trainer={engine_gap:.2e}")
        assert (ours - plain).abs().max() < 1e-3 and engine_gap < 1e-4
    else:
        mine, theirs = (ours - reference).abs().mean(), (plain - reference).abs().mean()
        print(f"RESULT bf16_gap_to_fp32 cascade={mine:.2e} sdpa={theirs:.2e}")
        assert mine <= 1.25 * theirs + 1e-3
PY
# sampling on the device (the logits never leave the GPU): each row's tokens for a fixed
# seed are those of the same row sampled alone (its stream is its key and position only),
# free rows and forced calls (the grammar's mask applied on the GPU) alike, float32.
# Jump-forward is off here: it writes a forced span's canonical tokens only when every
# live row is forced, so with it a forced row alone may take other tokens than in a batch
"${py[@]}" - <<'PY'
from dataclasses import replace

import torch
from looprl.chat import ChatRenderer
from looprl.engine import GenerationRequest, SamplingParams, ToolConstraint
from looprl.engine.hf import HFEngine
from looprl.envs import make_env
from looprl.model.load import load_causal_lm, load_tokenizer

tok = load_tokenizer("smollm2-135m")
renderer = ChatRenderer(tok, model_name="smollm2-135m")
env = make_env("tictactoe-move", {"tool_choice": "auto"})
reqs = []
for n, task in enumerate(env.tasks("train", n=8, seed=5)):
    obs = env.reset(task)
    forced = ToolConstraint(obs.tools, "required", renderer.format) if n % 2 else None
    prompt = renderer.prompt_ids(obs.messages, obs.tools)
    reqs.append(GenerationRequest(prompt, max_new_tokens=8 + 12 * (n % 3), constraint=forced))
model = load_causal_lm("smollm2-135m", torch.float32).to("cuda").eval()
engine = HFEngine(model, tok, renderer.eos_ids, jump_forward=False)
params = SamplingParams(temperature=1.0, max_new_tokens=32, seed=3)
batch = [o.ids for o in engine.generate(reqs, params)]
again = [o.ids for o in engine.generate(reqs, params)]
alone = [engine.generate([replace(r, stream=i)], params)[0].ids for i, r in enumerate(reqs)]
same = sum(a == b for a, b in zip(batch, alone))
print(f"RESULT cuda_batch_invariance={same}/{len(reqs)} repeat={'ok' if again == batch else 'differs'}")
assert again == batch, "a seeded call on CUDA did not repeat its tokens"
assert same == len(reqs), "a row's tokens on CUDA depend on the rows beside it"
PY
# the yardstick: engine vs generate (SmolLM2-135M and Qwen3-0.6B's shape, batches 8, 32,
# 64), the update of Qwen3-0.6B's shape (LoRA r16 and full, 16k-token micro-batches) with
# its peak memory against `looprl plan`, a 3-step run of the default model (its
# engine-vs-trainer logprob gap must stay under 5e-2), and the one-GPU FSDP update
# (bench/checks/gpu_fsdp.py: a process group of one, nothing split, FSDP2's path run)
"${py[@]}" bench/checks/gpu_yardstick.py --device cuda --out "$out/yardstick"
# the vllm engine on CUDA (make setup-vllm installs the CUDA `vllm` where nvidia-smi is
# found): 3 steps with LoRA and 3 with full fine-tuning, each pushing its weights to the
# server after every update; bf16 on both sides, so the gap is bf16's, not zero. Then
# its column in the rollout benchmark.
if [ "$VLLM" = 0 ]; then
  echo "vLLM steps left out (VLLM=1 adds them)"
else
make setup-vllm >/dev/null
for mode in lora full; do
  lora=true; [ "$mode" = full ] && lora=false
  "${looprl[@]}" run --set model.device=cuda --set rollout.engine=vllm \
    --set rollout.vllm_kv_cache_gb=8 --set model.lora.enabled=$lora --set train.steps=3 \
    --set eval.tasks=16 --set algo.tis_cap=2.0 --out "$out/vllm-$mode" --force
done
"${py[@]}" - "$out" <<'PY'
import json, sys
for name in ("vllm-lora", "vllm-full"):
    rows = [json.loads(l) for l in open(f"{sys.argv[1]}/{name}/metrics.jsonl")]
    gap = max(r["rollout/logprob_gap"] for r in rows)
    print(f"RESULT run={name} logprob_gap_max={gap:.2e}")
    assert gap < 5e-2, "vLLM's and the trainer's logprobs disagree: did the weights reach it?"
PY
"${py[@]}" bench/speed/rollout.py --device cuda --batches 32 --repeats 2 --vllm on
# overlapped rollouts: the vLLM server samples the next steps while the trainer steps
# (rollout.max_staleness 0, 1, 2 side by side; docs/training.md#overlapped-rollouts)
"${py[@]}" bench/speed/async.py --engine vllm --steps 8 --out "$out/async" \
  --set model.device=cuda
fi
echo "RESULT gpu_check_wall_s=$SECONDS"

