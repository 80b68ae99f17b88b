"""The GPU yardstick: rollout and update speed, memory against `looprl plan`, a 3-step run.

Measured the same way on every card.

    python bench/checks/gpu_yardstick.py --device cuda [--out DIR]
                                         [--parts engine,compiled,update,run,fsdp]
    python bench/checks/gpu_yardstick.py --device cpu --tiny    # a rehearsal of the code

`bench/checks/gpu_check.sh` runs it on a CUDA machine (sized for about four minutes on one
H100/H200). Everything runs in the dtype of a run on the device (`model.dtype=auto`:
bfloat16 on CUDA, float32 on the CPU). Two model shapes: SmolLM2-135M (the real model,
`smollm2-135m`) and Qwen3-0.6B's (its config, built in code with random weights, saved
once to a folder beside SmolLM2's tokenizer, whose ids are all within Qwen3's
vocabulary; speed and memory do not depend on the weights' values).

- engine: looprl's `hf` engine against transformers' `generate` (its own copy of the
  model) on the same tic-tac-toe prompts, the same new-token count, sampling at
  temperature 1, no grammar: decode tokens/s, counted up to EOS (bench/speed/rollout.py's
  timing, median of the repeats, the two interleaved). Batches 8, 32, 64 with 64 new
  tokens (`--tiny`: 2 and 4, 8 tokens).
- compiled: the same against `generate` with the engine's decode step compiled
  (`rollout.compile=on`: CUDA graphs on a GPU), SmolLM2 at batch 32 (`--tiny`: 4), and
  the seconds of its first call, which compiles the graphs.
- update: one policy update of the Qwen3-0.6B shape (looprl's `update_policy` on built
  episodes, bench/speed/update_memory.py's: real prompts, random generated tokens; the
  engine's logprobs stand in for the old ones, as in a fresh step, so the time is the
  micro-batches' forward and backward passes and the optimizer step), LoRA r16 and full
  fine-tuning, 16,384 tokens a micro-batch (`--tiny`: 512, a 2-layer model): trained
  tokens/s (the episodes' tokens over the update's seconds, after one warm-up update
  that also allocates the optimizer state) and the peak memory
  (`torch.cuda.max_memory_allocated`; on the CPU the process's peak resident set).
- plan: `looprl plan --json` for the same config on a device of the card's size, its
  update phase (with what every phase holds, less the CUDA context, which
  max_memory_allocated does not count) against each measured peak; `plan_error_pct` is
  the larger |error|.
- run: a 3-step `looprl run` of smollm2-135m (`--tiny`: tiny-random) in a child
  process: the largest engine-vs-trainer logprob gap it logged and its seconds a step.
- fsdp: one update of smollm2-135m (`--tiny`: tiny-random), full fine-tuning, the
  episodes and micro-batches of `update`, through `train.shard: fsdp`'s FSDP2 units over
  a process group of one (on CUDA bf16 compute, float32 gradient reduction): its seconds
  (`fsdp_step_s`, median of the repeats after a warm-up) and peak memory (`fsdp_peak_gb`).

Prints a `RESULT` line per measurement, then one summary line:

    RESULT device=NVIDIA_H100_80GB_HBM3 dtype=bfloat16 engine_vs_generate_b8=X ...
        engine_compiled_vs_generate_b32=X engine_compile_s=X update_tokens_per_s_lora=X
        update_peak_gb_lora=X update_tokens_per_s_full=X update_peak_gb_full=X
        plan_error_pct=X run_logprob_gap_max=X run_step_s=X fsdp_step_s=X fsdp_peak_gb=X
"""

from __future__ import annotations

import gc
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from looprl.chat import ChatRenderer
from looprl.config import load_config
from looprl.engine.hf import HFEngine
from looprl.loop.optim import make_optimizer
from looprl.loop.policy import load_policy
from looprl.loop.update import UpdateState, update_policy
from looprl.model.load import load_causal_lm, load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.checks.gpu_fsdp import fsdp_part
from bench.harness import ROOT, arguments, looprl_run, median, print_result
from bench.speed.rollout import prompts, run_generate, run_looprl, sync
from bench.speed.update_memory import episodes

# Qwen/Qwen3-0.6B's config.json, the shape that matters for speed and memory
QWEN3_0_6B = dict(
    vocab_size=151_936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40_960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=1,  # SmolLM2's tokenizer's, which the folder carries
    eos_token_id=2,
    pad_token_id=2,
)
# the largest engine-vs-trainer logprob gap the 3-step run may log (bfloat16's on a GPU)
MAX_LOGPROB_GAP = 5e-2
TINY_QWEN3 = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)


@dataclass(frozen=True)
class Sizes:
    """How big each measurement is: the card's sizes, or `--tiny`'s for a CPU rehearsal."""

    batches: tuple[int, ...] = (8, 32, 64)
    new_tokens: int = 64
    repeats: int = 3
    tasks: int = 16  # the update's tasks, `group` episodes each, `response` tokens each
    group: int = 8
    response: int = 256
    micro_batch_tokens: int = 16_384
    run: tuple[str, ...] = ("eval.tasks=16",)


TINY = Sizes(
    batches=(2, 4),
    new_tokens=8,
    repeats=1,
    tasks=2,
    group=2,
    response=8,
    micro_batch_tokens=512,
    run=(
        "model.name=tiny-random",
        "rollout.tasks_per_step=2",
        "rollout.group_size=4",
        "rollout.max_new_tokens=40",
        "eval.tasks=4",
    ),
)


def run_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def card_name(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return name.replace(" ", "_")


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def qwen3_folder(out: Path, tiny: bool, device: torch.device) -> Path:
    """A folder `model.name` can name: Qwen3-0.6B's shape with random weights (seeded),
    saved in bfloat16, and SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**{**QWEN3_0_6B, **(TINY_QWEN3 if tiny else {})})
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it is fast
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    load_tokenizer("smollm2-135m").save_pretrained(out)
    del model
    free(device)
    return out


def engine_speeds(name: str, sizes: Sizes, device: torch.device) -> dict[int, tuple]:
    """{batch: (engine tokens/s, generate tokens/s)} for the model `name`."""
    dtype = run_dtype(device)
    tokenizer = load_tokenizer(name)
    renderer = ChatRenderer(tokenizer, model_name=name)
    model = load_causal_lm(name, dtype).to(device).eval()
    # `generate` gets its own copy: the engine switches attention and linear layers of its
    reference = load_causal_lm(name, dtype).to(device).eval()
    engine = HFEngine(model, tokenizer, renderer.eos_ids, batch_size=max(sizes.batches))
    pool = prompts(renderer, max(sizes.batches))
    run_looprl(engine, pool[:2], 0, sizes.new_tokens)  # warm-up
    run_generate(reference, tokenizer, pool[:2], 0, sizes.new_tokens)
    speeds = {}
    for size in sizes.batches:
        ours, theirs = [], []
        for repeat in range(sizes.repeats):
            n, seconds = run_looprl(engine, pool[:size], repeat, sizes.new_tokens)
            ours.append(n / seconds)
            n, seconds = run_generate(reference, tokenizer, pool[:size], repeat, sizes.new_tokens)
            theirs.append(n / seconds)
        speeds[size] = (median(ours), median(theirs))
    return speeds


def engine_part(shapes: dict[str, str], sizes: Sizes, device: torch.device) -> dict:
    """The engine against `generate` for each shape; the summary's fields."""
    summary = {}
    for shape, name in shapes.items():
        speeds = engine_speeds(name, sizes, device)
        free(device)
        for size, (ours, theirs) in speeds.items():
            print_result(
                {
                    "engine": shape,
                    "batch": size,
                    "new_tokens": sizes.new_tokens,
                    "engine_tok_s": f"{ours:.1f}",
                    "generate_tok_s": f"{theirs:.1f}",
                    "engine_vs_generate": f"{ours / theirs:.2f}",
                }
            )
            prefix = "" if shape == "smollm2-135m" else "qwen3_"
            summary[f"{prefix}engine_vs_generate_b{size}"] = f"{ours / theirs:.2f}"
    return summary


def compiled_engine_part(sizes: Sizes, device: torch.device) -> dict:
    """The engine with its decode step compiled (`rollout.compile=on`: CUDA graphs on a
    GPU, inductor on the CPU; engine/compiled_step.py) against `generate` on SmolLM2 at
    batch 32 (`--tiny`: the largest batch), timed as `engine_part`, after one call that
    compiles its graphs (its seconds: `engine_compile_s`), and how many graphs ran
    without capture (`cudagraph_skips`). Cascade attention is off: a batch whose rows
    share a kept prompt head decodes eagerly."""
    from torch._dynamo.utils import counters

    name, size = "smollm2-135m", min(32, max(sizes.batches))
    dtype = run_dtype(device)
    tokenizer = load_tokenizer(name)
    renderer = ChatRenderer(tokenizer, model_name=name)
    model = load_causal_lm(name, dtype).to(device).eval()
    reference = load_causal_lm(name, dtype).to(device).eval()
    engine = HFEngine(
        model,
        tokenizer,
        renderer.eos_ids,
        batch_size=size,
        cascade_attention=False,
        compile_step="on",
    )
    batch = prompts(renderer, size)
    start = time.perf_counter()
    run_looprl(engine, batch, 0, sizes.new_tokens)  # compiles (or captures) its graphs
    compile_s = time.perf_counter() - start
    run_generate(reference, tokenizer, batch[:2], 0, sizes.new_tokens)  # warm-up
    ours, theirs = [], []
    for repeat in range(sizes.repeats):
        n, seconds = run_looprl(engine, batch, repeat, sizes.new_tokens)
        ours.append(n / seconds)
        n, seconds = run_generate(reference, tokenizer, batch, repeat, sizes.new_tokens)
        theirs.append(n / seconds)
    ratio = median(ours) / median(theirs)
    fields = {
        "engine_compiled_tok_s": f"{median(ours):.1f}",
        "generate_tok_s": f"{median(theirs):.1f}",
        "shapes": engine.compiled.shapes,
        # > 0: a graph ran without CUDA graph capture (its log says why)
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "compile_s": f"{compile_s:.0f}",
    }
    print_result({"engine": f"{name} compiled", "batch": size, **fields})
    del engine, model, reference
    free(device)
    return {
        f"engine_compiled_vs_generate_b{size}": f"{ratio:.2f}",
        "engine_compile_s": fields["compile_s"],
    }


def update_overrides(folder: Path, lora: bool, sizes: Sizes, device: torch.device) -> list:
    return [
        f"model.name={folder}",
        f"model.device={device.type}",
        f"model.lora.enabled={str(lora).lower()}",
        "model.lora.rank=16",
        f"rollout.tasks_per_step={sizes.tasks}",
        f"rollout.group_size={sizes.group}",
        f"rollout.max_new_tokens={sizes.response}",
        f"train.micro_batch_tokens={sizes.micro_batch_tokens}",
        "algo.num_minibatches=1",
    ]


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def measure_update(
    overrides: list[str], sizes: Sizes, device: torch.device, wrap: Callable | None = None
) -> dict:
    """Tokens/s and peak memory of `update_policy` on one step's built episodes (`wrap`:
    called on the model, train config and device first, as `fsdp_part` shards it)."""
    cfg = load_config(None, overrides)
    policy = load_policy(cfg)
    if wrap is not None:
        wrap(policy.model, cfg.train, policy.device)
    groups = episodes(cfg, policy, sizes.response)
    optimizer = make_optimizer(policy.trainable_parameters(), cfg.train.optimizer, 1e-6, 0.0)

    def update() -> None:
        update_policy(
            policy,
            optimizer,
            groups,
            cfg.algo,
            cfg.train,
            group_size=sizes.group,
            max_tokens=sizes.response,
            seed=0,
            state=UpdateState(sizes.micro_batch_tokens),
            fresh=True,
        )

    update()  # warm-up: kernels chosen, the optimizer state allocated at its first step
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(sizes.repeats):
        start = time.perf_counter()
        update()
        sync(device)
        seconds.append(time.perf_counter() - start)
    tokens = sum(len(e.token_ids) for g in groups for e in g.episodes)
    return {"tokens": tokens, "tokens_per_s": tokens / median(seconds), "peak": peak_bytes(device)}


def plan_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda-{torch.cuda.get_device_properties(device).total_memory / 2**30:.0f}g"
    return "cpu-24g"


def planned_update_peak(overrides: list[str], device: torch.device) -> float:
    """`looprl plan --json`'s update phase with what every phase holds; on a GPU less the
    CUDA context (its `framework` row), which max_memory_allocated does not count."""
    command = [sys.executable, "-m", "looprl.cli", "plan", "--json", "--device"]
    command += [plan_device(device)] + [f"--set={item}" for item in overrides]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"looprl plan failed:\n{done.stderr[-2000:]}")
    plan = json.loads(done.stdout)
    held = sum(plan["persistent"].values())
    if device.type == "cuda":
        held -= plan["persistent"].get("framework", 0.0)
    return held + plan["phases"]["update"]["total"]


def update_part(folder: Path, sizes: Sizes, device: torch.device) -> dict:
    """LoRA r16 and full fine-tuning of the Qwen3 shape; the summary's fields."""
    summary, errors = {}, []
    for mode in ("lora", "full"):
        overrides = update_overrides(folder, mode == "lora", sizes, device)
        measured = measure_update(overrides, sizes, device)
        free(device)  # the policy and its optimizer, gone with the call
        planned = planned_update_peak(overrides, device)
        error = 100 * (planned - measured["peak"]) / measured["peak"]
        errors.append(abs(error))
        print_result(
            {
                "update": mode,
                "shape": "qwen3-0.6b",
                "tokens": measured["tokens"],
                "micro_batch_tokens": sizes.micro_batch_tokens,
                "tokens_per_s": f"{measured['tokens_per_s']:.0f}",
                "peak_gb": f"{measured['peak'] / 1e9:.2f}",
                "plan_gb": f"{planned / 1e9:.2f}",
                "plan_error_pct": f"{error:+.1f}",
            }
        )
        summary[f"update_tokens_per_s_{mode}"] = f"{measured['tokens_per_s']:.0f}"
        summary[f"update_peak_gb_{mode}"] = f"{measured['peak'] / 1e9:.2f}"
    summary["plan_error_pct"] = f"{max(errors):.1f}"
    return summary


def run_part(out: Path, sizes: Sizes, device: torch.device) -> dict:
    """A 3-step `looprl run` in a child process: its logprob gap and seconds a step."""
    overrides = [
        f"model.device={device.type}",
        "train.steps=3",
        "train.checkpoint_every=0",
        "logging.trackers=[]",
        *sizes.run,
    ]
    run = looprl_run(out, overrides=overrides, echo=False)
    if run.returncode != 0:
        sys.exit(f"looprl run failed:\n{run.stderr_tail[-2000:]}")
    gap = max(r["rollout/logprob_gap"] for r in run.metrics)
    step_s = sum(r["perf/step_s"] for r in run.metrics) / len(run.metrics)
    print_result(
        {
            "run": out.name,
            "steps": len(run.metrics),
            "logprob_gap_max": f"{gap:.2e}",
            "step_s": f"{step_s:.2f}",
            "wall_s": f"{run.wall_s:.0f}",
        }
    )
    return {"run_logprob_gap_max": f"{gap:.2e}", "run_step_s": f"{step_s:.2f}"}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a rehearsal")
    parser.add_argument("--tiny", action="store_true", help="rehearsal sizes (minutes on a CPU)")
    parser.add_argument("--out", default=None, help="folder for the model and the run")
    parser.add_argument(
        "--parts", default="engine,compiled,update,run,fsdp", help="which measurements"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is available")
    sizes = TINY if args.tiny else Sizes()
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu-yardstick-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    started = time.perf_counter()
    summary = {"device": card_name(device), "dtype": str(run_dtype(device)).split(".")[-1]}
    folder = None
    if "engine" in parts or "update" in parts:
        folder = qwen3_folder(out / "qwen3-0.6b-shape", args.tiny, device)
    if "engine" in parts:
        summary |= engine_part(
            {"smollm2-135m": "smollm2-135m", "qwen3-0.6b": str(folder)}, sizes, device
        )
    if "compiled" in parts:
        summary |= compiled_engine_part(sizes, device)
    if "update" in parts:
        summary |= update_part(folder, sizes, device)
    if "run" in parts:
        summary |= run_part(out / "run-3-steps", sizes, device)
    if "fsdp" in parts:
        summary |= fsdp_part(sizes, sizes is TINY, device, measure_update)
    summary["wall_s"] = f"{time.perf_counter() - started:.0f}"
    print_result(summary)
    gap = float(summary.get("run_logprob_gap_max", 0.0))
    if gap >= MAX_LOGPROB_GAP:
        sys.exit(f"engine and trainer logprobs disagree: gap {gap:.2e} >= {MAX_LOGPROB_GAP}")


if __name__ == "__main__":
    main()
