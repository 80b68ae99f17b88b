"""How close `looprl plan` comes to the peak memory of real runs on this CPU.

    .venv/bin/python bench/checks/plan_accuracy.py [--only NAME ...] \
        [--saved runs/plan-accuracy.json]
    .venv/bin/python bench/checks/plan_accuracy.py --baseline

Each row is a short run (2 training steps, a small eval) of a different size or shape:
tiny-random and SmolLM2-135M, LoRA and full fine-tuning, short and long prompts, short
and long generations. The run goes in a child process, `looprl run`, whose peak resident
set the kernel reports when it ends (`wait4`: the whole run, load and report included);
the prediction is `looprl plan --json`'s peak for the same config on a CPU device. Two steps,
because AdamW allocates its state at the first optimizer step, after the first update's
activations are freed (full fine-tuning: the state then fills their freed blocks); only
from the second update on does a peak hold both, as every later step of a real run does.
Measurements are saved as they come (`--saved`), so `--predict-only` compares a changed planner with
them without running anything again. Prints predicted / measured / error per row and ends
with

    RESULT plan_max_abs_error_pct=X rows=N

`--baseline` measures the framework's own footprint instead (what a run's process holds
before its model: Python, torch, transformers, peft, the tokenizer, xgrammar's tables,
the LoRA library), the planner's FRAMEWORK_CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import arguments, looprl_run, result_line

SHORT = ["train.steps=2", "train.checkpoint_every=0", "logging.trackers=[]",
         "eval.tasks=8", "eval.greedy_tasks=8"]  # fmt: skip
ROWS = {
    "tiny-lora-forced": ["model.name=tiny-random", "rollout.max_new_tokens=32"],
    "tiny-lora-long-prompts": [
        "model.name=tiny-random", "env.name=extraction", "rollout.max_new_tokens=96",
        "train.micro_batch_tokens=4096",
    ],
    "tiny-full-long-prompts": [
        "model.name=tiny-random", "model.lora.enabled=false", "env.name=extraction",
        "rollout.max_new_tokens=96", "train.micro_batch_tokens=4096",
    ],
    "smollm2-lora": ["model.name=smollm2-135m", "rollout.max_new_tokens=32"],
    "smollm2-full": ["model.name=smollm2-135m", "rollout.max_new_tokens=32",
                     "model.lora.enabled=false"],
    "smollm2-full-8bit": ["model.name=smollm2-135m", "rollout.max_new_tokens=32",
                          "model.lora.enabled=false", "train.optimizer=adamw_8bit"],
}  # fmt: skip
BASELINE = """
import resource, sys
import looprl.cli, looprl.loop.train
from looprl.config import load_config
from looprl.engine.requests import generation_request
from looprl.envs import make_env
from looprl.loop.policy import load_policy
policy = load_policy(load_config(None, ["model.name=tiny-random", sys.argv[1]]))
env = make_env("tictactoe-move", {})
obs = env.reset(env.tasks("train", n=1, seed=0)[0])
ids = policy.renderer.prompt_ids(obs.messages, obs.tools)
generation_request(ids, obs.tools, obs.tool_choice, policy.renderer.format, engine=policy.engine)
weights = sum(p.numel() * p.element_size() for p in policy.model.parameters())
rss = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
print(rss - weights)
"""


def measure(overrides: list[str]) -> dict:
    """Run `looprl run` for the config; its peak RSS from the kernel and its wall time."""
    out = Path(tempfile.mkdtemp(prefix="plan-accuracy-"))
    run = looprl_run(out, overrides=SHORT + overrides, echo=False)
    if run.returncode != 0:
        sys.exit(f"looprl run failed: {' '.join(overrides)}\n{run.stderr_tail[-2000:]}")
    return {
        "measured_bytes": run.peak_rss_bytes,
        "logged_peak_gib": max(m["perf/peak_rss_gb"] for m in run.metrics),
        "response_len": run.metrics[-1]["response_len"],
        "wall_s": round(run.wall_s, 1),
    }


def predict(overrides: list[str]) -> dict:
    """`looprl plan --json` for the same config on a CPU device."""
    command = [sys.executable, "-m", "looprl.cli", "plan", "--json", "--device", "cpu-24g"]
    for item in SHORT + overrides:
        command += ["--set", item]
    result = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    phases = {name: phase["total"] for name, phase in result["phases"].items()}
    return {"predicted_bytes": result["peak_bytes"], "peak_phase": result["peak_phase"],
            "persistent_bytes": sum(result["persistent"].values()), "phases": phases}  # fmt: skip


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--only", nargs="*", default=None, help="rows to run")
    parser.add_argument("--saved", default="runs/plan-accuracy.json")
    parser.add_argument("--predict-only", action="store_true", help="use saved measurements")
    parser.add_argument("--baseline", action="store_true", help="measure FRAMEWORK_CPU")
    args = parser.parse_args()
    if args.baseline:
        values = {}
        for lora in ("false", "true"):
            command = [sys.executable, "-c", BASELINE, f"model.lora.enabled={lora}"]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            values[lora] = int(done.stdout.strip().splitlines()[-1]) / 1e9
            print(f"framework with model.lora.enabled={lora}: {values[lora]:.3f} GB")
        lora_gb = values["true"] - values["false"]
        print(result_line({"framework_cpu_gb": f"{values['false']:.3f}",
                           "lora_library_gb": f"{lora_gb:.3f}"}))  # fmt: skip
        return
    saved_path = Path(args.saved)
    saved = json.loads(saved_path.read_text()) if saved_path.exists() else {}
    names = args.only or list(ROWS)
    errors = []
    print(f"{'config':<24} {'predicted GB':>12} {'measured GB':>12} {'error':>8}  peak phase")
    for name in names:
        if not args.predict_only or name not in saved:
            if args.predict_only:
                continue
            saved[name] = measure(ROWS[name])
            saved_path.parent.mkdir(parents=True, exist_ok=True)
            saved_path.write_text(json.dumps(saved, indent=2))
        row = {**saved[name], **predict(ROWS[name])}
        error = 100 * (row["predicted_bytes"] - row["measured_bytes"]) / row["measured_bytes"]
        errors.append(abs(error))
        predicted, measured = row["predicted_bytes"] / 1e9, row["measured_bytes"] / 1e9
        print(
            f"{name:<24} {predicted:>12.2f} {measured:>12.2f} {error:>+7.1f}%  {row['peak_phase']}"
        )
    worst = max(errors, default=0.0)
    print(result_line({"plan_max_abs_error_pct": f"{worst:.1f}", "rows": len(errors)}))


if __name__ == "__main__":
    main()
