"""One full RL step (rollouts + GSPO update): looprl vs TRL's `GRPOTrainer`, side by side.

    .venv/bin/pip install -e ".[bench]" "torch==2.13.0"   # TRL, once (or: make bench)
    .venv/bin/python bench/speed/step.py            # the default benchmark (8 x 8, 64 tokens)
    .venv/bin/python bench/speed/step.py --steps 1 --tasks 4 --group 4 --updates 2 \
        --max-new-tokens 32                          # quick (what `make bench` runs)

Each side runs in its own child process (same interpreter, same CPU threads), one after
the other (looprl as `looprl run`, TRL as bench/speed/step_trl.py), so neither inherits
the other's warm caches or memory: first looprl, then TRL.
Each plays `--warmup` (1) + `--steps` (3) RL steps; a step is 8 tasks x group 8 = 64
completions followed by the GSPO update over them (4 optimizer updates of 16). The
warm-up step is dropped and the medians of the rest are compared. The last line is

    RESULT step_time_ratio_vs_trl=X rollout_time_ratio_vs_trl=R update_time_ratio_vs_trl=U
           looprl_step_s=Y trl_step_s=Z ... looprl_all_equal_groups=A trl_all_equal_groups=B

(one line) with X = looprl seconds per step / TRL seconds per step (below 1: looprl is
faster), R and U the same ratio for the rollout and the update share of the step, and
A, B the all-equal groups per measured step on each side (comma-separated, "of N").

No ratio without an update: if in any measured step every group of one side scored the
same reward, that side's advantages were all 0 and its step did no update worth timing
(looprl skips such groups entirely; TRL runs them anyway). The script then prints why,
prints the `RESULT` line without the three ratio keys (with `ratio=refused`), and exits
with status 1.

This is a benchmark, not a test: run it on a quiet machine (with 2 threads, a core
taken by anything else slows a step several-fold). The default size takes tens of
minutes on a 2-core CPU, most of it on the TRL side.

What is timed
-------------
- looprl: `looprl run CONFIG` in a child process, into a temp folder; the per-step time
  is its own `perf/step_s` from RUN/metrics.jsonl: from sampling the step's tasks to
  after the update and the scheduler step. The baseline and final eval (set to 1
  episode each), checkpointing and the report are outside `perf/step_s`. The rollout
  share is derived exactly from the logged `perf/rollout_tokens_per_s` and the episodes'
  response lengths.
- TRL: `GRPOTrainer.train()`; a `TrainerCallback` takes the time from `on_step_begin` of
  the first optimizer step of a generation round to `on_step_end` of its last one. One
  round = one generation of all completions (inside the first optimizer step, in
  `_prepare_inputs`) + the old-logprob pass + the rewards + its optimizer updates, i.e.
  exactly one RL step. Model loading, PEFT wrapping and optimizer creation are outside,
  as they are for looprl. The rollout share is the time spent in `GRPOTrainer._generate`
  (tokenize, `model.generate`, decode) plus the reward function.

Settings, and how each maps onto both sides (all are flags; defaults shown)
--------------------------------------------------------------------------
- model smollm2-135m, float32, CPU: looprl `model.name/dtype/device`; TRL gets the model
  and tokenizer that `looprl.model.load.load_causal_lm` / `load_tokenizer` load (same weights).
- LoRA r=16, alpha=32, dropout 0, all linear layers: looprl `model.lora.*` with
  `target_modules="all-linear"`; TRL `peft_config=LoraConfig(..., target_modules="all-linear")`.
- 8 tasks x group 8 = 64 completions per step: looprl `rollout.tasks_per_step/group_size`
  (and `rollout.batch_size`=64 so all decode together, as TRL's single `generate` call
  does); TRL `num_generations=8` and a generation batch of 64 (below).
- max 64 new tokens, temperature 1, top_p 1, top_k off: `rollout.*`; TRL
  `max_completion_length`, `temperature`, `top_p`, `top_k=0`. Both stop at `<|im_end|>`.
- lr 4e-4 constant, AdamW, weight decay 0, grad-norm clip 1.0: looprl `train.*`; TRL
  `learning_rate`, `lr_scheduler_type="constant"`, `optim="adamw_torch"` (the plain
  `torch.optim.AdamW` looprl uses), `weight_decay=0`, `max_grad_norm=1.0`.
- 4 optimizer updates per rollout batch: looprl `algo.num_minibatches=4`. TRL:
  `per_device_train_batch_size=16`, `gradient_accumulation_steps=1`,
  `steps_per_generation=4`, `num_iterations=1`. TRL's `generation_batch_size` is then
  per_device_train_batch_size x steps_per_generation = 64 = 8 prompts x 8 generations;
  `_prepare_inputs` generates once every steps_per_generation x num_iterations = 4
  optimizer steps, shuffles the 64 completions and hands 16 to each of the 4 optimizer
  steps (one micro-batch each, since gradient_accumulation_steps=1). Because
  gradient_accumulation_steps (1) is not a multiple of 4, TRL recomputes the old
  logprobs of all 64 completions once before the updates (looprl takes its engine's,
  below). looprl splits
  whole task groups into minibatches (the update's minibatches), so it makes
  min(updates, tasks) updates; TRL is given that same number.
- GSPO: looprl `algo.name=gspo` with its defaults eps_low=3e-4, eps_high=4e-4
  (`looprl.config.DEFAULT_CLIP`); TRL `importance_sampling_level="sequence"`,
  `loss_type="grpo"` (per-sequence mean, then mean over sequences: with a sequence ratio
  this is GSPO's sum over sequences / their count, looprl's normaliser),
  `epsilon=3e-4`, `epsilon_high=4e-4`, `scale_rewards="group"`. No KL: looprl
  `algo.kl_coef=0`, TRL `beta=0` (no reference model on either side).
- No gradient checkpointing (TRL's default is on: set off), no mixed precision
  (`bf16=False`), no vLLM, `use_cpu=True`, dropout disabled, no logging/saving.
- Task: `bench.speed.step_env:MoveInText` (bench/speed/step_env.py) with `tool_choice="auto"` on
  both sides: `tictactoe-move`'s boards and prompts (tool schema included), with a reward
  the model can earn in free text: 0.8 x the score of the square it names (a valid
  `choose_square` call's square, else the first digit 1-9 of its text; +1 win, +0.8
  optimal, 0 legal, -1 occupied or none named) + 0.2 x brevity (1 - characters of its
  text / 500, capped). Under `tictactoe-move` itself the untrained model, sampling
  freely, almost never writes a valid call, so every group scored -1 on both sides,
  looprl skipped its whole update and the ratio set rollouts plus TRL's update against
  looprl's rollouts alone. Here the answers' lengths (and now and then the square they
  name) differ within a group, so groups get a reward spread without a forced call;
  the table prints the all-equal groups per step for each side. With the env default
  "required", looprl would force the call with a grammar (and jump-forward decoding)
  that TRL has no counterpart for; `--looprl-tool-choice required` times looprl that way
  (the move is then the forced call's square, with no text) against the same TRL run
  (`--reuse-trl runs/bench-step/trl.json`, saved by `--save runs/bench-step` on a first
  run with the same settings; a result saved for another workload or other settings is
  refused).

Same prompts, same scoring
--------------------------
The TRL dataset is built from the env: step k takes `env.tasks("train", n=8,
seed=looprl.seeds.step_seed(seed, k))` (the seed `looprl run` uses), in order
(`shuffle_dataset=False`), and each prompt is the text looprl's `ChatRenderer` renders for
`env.reset(task)` (SmolLM2's template ignores `tools`, so looprl puts the tool schemas in
the system prompt; TRL gets that text as a plain, non-conversational prompt, and no
`tools=`, which would start TRL's own tool loop). The script checks, and prints, that
TRL's own prompt tokenization (`GRPOTrainer._tokenize_prompts`) gives exactly the ids of
`ChatRenderer.prompt_ids`, that TRL stops on the same EOS ids, and that both sides saw the
same tasks at every step (looprl's transcripts vs the TRL reward calls). The TRL reward
function scores a completion as looprl's rollout does: decode the completion
ids with the renderer, parse them into an assistant message (`require_call=True`), and
`env.step(message).reward` in a fresh env reset to the same task; a completion the token
limit cut (no EOS) scores the env's lowest reward unless it holds a whole valid call, as
looprl's rollout scores it. (Before that rule was on the TRL side too, the two sides
learned different rewards: looprl's completions fell from ≈ 55 to ≈ 30 tokens after the
warm-up step while TRL's stayed at ≈ 60, and the step ratio compared unequal work.)

Not the same, by design of each library (so part of what is measured)
---------------------------------------------------------------------
Sampling is random on both sides, so completions (and their lengths and rewards)
differ; the table shows the mean completion length, reward and number of all-equal
reward groups per side. looprl shares each prompt's prefill across its group (rollout
and trainer), skips the forward/backward of advantage-0 sequences (a group whose rewards
are all equal: the table counts them per side, as they thin looprl's update), takes the
engine's sampling logprobs as the old ones (its `hf` engine samples from the policy module
itself, in fp32: no old-logprob pass; TRL recomputes them, as looprl does for any other
sampler) and micro-batches by a token budget (`train.micro_batch_tokens`); TRL trains on
every sequence and also computes the per-token entropy in its loss pass. The advantages
differ slightly (looprl: population std + 1e-6; TRL: Bessel-corrected std + 1e-4), which
does not change the amount of work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from looprl.config import DEFAULT_CLIP, config_from_dict, to_yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import ROOT, looprl_run, median, read_jsonl, result_line

# The workload's env lives next to this script (bench/speed/step_env.py) and is named like
# a user env, `package.module:Class`: the `looprl run` child and the TRL child import it
# from the repository root (bench.harness puts it on their path).
ENV_NAME = "bench.speed.step_env:MoveInText"
ENV_ARGS: dict[str, Any] = {"tool_choice": "auto"}  # no grammar: see the module docstring
EPS_LOW, EPS_HIGH = DEFAULT_CLIP["gspo"]


# ============================================================================ settings


@dataclass(frozen=True)
class Settings:
    """Everything both sides must share; each field is a command-line flag."""

    model: str = "smollm2-135m"
    tasks: int = 8
    group: int = 8
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    lr: float = 4e-4
    updates: int = 4
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    eps_low: float = EPS_LOW
    eps_high: float = EPS_HIGH
    steps: int = 3
    warmup: int = 1
    seed: int = 0
    looprl_tool_choice: str = "auto"  # "required": looprl's default (grammar); TRL unchanged

    @property
    def rounds(self) -> int:
        """RL steps each side plays: the warm-up ones, then the measured ones."""
        return self.warmup + self.steps

    @property
    def completions(self) -> int:
        return self.tasks * self.group

    @property
    def effective_updates(self) -> int:
        """looprl never splits a task group across minibatches, so with fewer tasks than
        updates it makes one update per task; TRL is given the same number."""
        return min(self.updates, self.tasks)

    @property
    def minibatch(self) -> int:
        return self.completions // self.effective_updates


def settings_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser with one flag per `Settings` field (defaults shown)."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n", 1)[0])
    for name, value in asdict(Settings()).items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=type(value), default=value, help=f"default {value}")
    return parser


def settings_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Settings:
    settings = Settings(**{k: getattr(args, k) for k in asdict(Settings())})
    check_settings(settings, parser)
    return settings


def parse_args(argv: list[str] | None = None) -> tuple[Settings, argparse.Namespace]:
    parser = settings_parser(__doc__)
    parser.add_argument("--save", type=Path, help="also keep both sides' results in this folder")
    parser.add_argument(
        "--reuse-trl",
        type=Path,
        help="compare against a TRL result saved by --save (same settings) instead of rerunning",
    )
    args = parser.parse_args(argv)
    return settings_from(args, parser), args


def check_settings(s: Settings, parser: argparse.ArgumentParser) -> None:
    """Reject settings for which the two sides could not do the same work."""
    if s.group < 2:
        parser.error("--group must be >= 2 (TRL needs two completions per prompt)")
    if min(s.tasks, s.updates, s.steps, s.max_new_tokens) < 1 or s.warmup < 0:
        parser.error("--tasks, --updates, --steps and --max-new-tokens must be >= 1")
    if s.tasks % s.effective_updates:
        parser.error(
            f"--tasks {s.tasks} must be a multiple of the updates ({s.effective_updates}): "
            "looprl splits whole task groups, TRL needs equal minibatches"
        )


def settings_argv(s: Settings) -> list[str]:
    """The flags that rebuild `s` in a child process."""
    out: list[str] = []
    for name, value in asdict(s).items():
        out += [
            "--" + name.replace("_", "-"),
            repr(value) if isinstance(value, float) else str(value),
        ]
    return out


# ============================================================================ looprl side


def looprl_config(s: Settings) -> Any:
    """The run config: the shared settings, plus a 1-episode eval and no periodic
    checkpoints or TensorBoard (none of which is inside `perf/step_s` anyway), and every
    episode's transcript kept so the parent can check which tasks each step used."""
    return config_from_dict({
        "model": {
            "name": s.model, "dtype": "float32", "device": "cpu", "gradient_checkpointing": False,
            "lora": {"enabled": True, "rank": s.lora_rank, "alpha": float(s.lora_alpha),
                     "dropout": float(s.lora_dropout), "target_modules": "all-linear"},
        },
        "env": {"name": ENV_NAME, "args": {**ENV_ARGS, "tool_choice": s.looprl_tool_choice}},
        "rollout": {
            "tasks_per_step": s.tasks, "group_size": s.group, "max_new_tokens": s.max_new_tokens,
            "temperature": float(s.temperature), "top_p": float(s.top_p), "top_k": 0,
            "batch_size": s.completions,
        },
        "algo": {
            "name": "gspo", "eps_low": s.eps_low, "eps_high": s.eps_high,
            "num_minibatches": s.updates, "kl_coef": 0.0, "dynamic_sampling": False,
            "scale_advantages": True,
        },
        "train": {
            "steps": s.rounds, "lr": s.lr, "lr_schedule": "constant", "warmup_steps": 0,
            "weight_decay": 0.0, "max_grad_norm": 1.0, "checkpoint_every": 0,
        },
        "eval": {"tasks": 1, "samples_per_task": 1},
        "logging": {"trackers": [], "sample_every": 1, "samples_per_log": s.completions},
        "seed": s.seed,
    })  # fmt: skip


def run_looprl(s: Settings) -> dict[str, Any]:
    """`looprl run CONFIG` into a temp folder, in a child process; per-step numbers from
    its metrics and samples."""
    with tempfile.TemporaryDirectory(prefix="looprl-bench-") as tmp:
        config = Path(tmp) / "config.yaml"
        config.write_text(to_yaml(looprl_config(s)))
        run = looprl_run(Path(tmp) / "run", config)
        if run.returncode != 0:
            raise SystemExit(f"looprl run failed with exit code {run.returncode}")
        metrics = run.metrics
        samples = read_jsonl(run.out / "samples" / "train.jsonl")
    by_step: dict[int, list[dict[str, Any]]] = {}
    for record in samples:
        by_step.setdefault(int(record["step"]), []).append(record)
    steps = []
    for m in metrics:
        episodes = by_step.get(int(m["step"]), [])
        tokens = sum(e["response_len"] for e in episodes)
        rollout_s = tokens / m["perf/rollout_tokens_per_s"] if tokens else float("nan")
        steps.append({
            "step_s": m["perf/step_s"],
            "rollout_s": rollout_s,
            "reward_mean": m["rollout/rewards_mean"],
            "completion_tokens": m["response_len"],
            "zero_std_groups": m["train/zero_std_groups"],
            "tasks": ordered_unique(e["task_id"] for e in episodes),
        })  # fmt: skip
    return {"steps": steps, "updates": s.effective_updates}


# ============================================================================ driver


def ordered_unique(items: Any) -> list[str]:
    return list(dict.fromkeys(items))


def run_side(side: str, s: Settings, workdir: Path) -> dict[str, Any]:
    """Run one side in a fresh interpreter: looprl through `looprl run`, TRL through
    bench/speed/step_trl.py, which writes its result to a JSON file."""
    print(f"\n=== {side}: {s.rounds} RL steps ({s.warmup} warm-up) ===", flush=True)
    if side == "looprl":
        return run_looprl(s)
    out = workdir / "trl.json"
    script = Path(__file__).with_name("step_trl.py")
    cmd = [sys.executable, str(script), "--result-json", str(out), *settings_argv(s)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads(out.read_text())


def side_summary(result: dict[str, Any], warmup: int) -> dict[str, float]:
    """Medians over the measured steps (the warm-up steps dropped)."""
    measured = result["steps"][warmup:]
    if not measured:
        raise SystemExit("no measured steps came back")

    def med(key: str) -> float:
        return median(step[key] for step in measured)

    return {
        "n": len(measured),
        "step_s": med("step_s"),
        "min_s": min(step["step_s"] for step in measured),
        "max_s": max(step["step_s"] for step in measured),
        "rollout_s": med("rollout_s"),
        "update_s": median(x["step_s"] - x["rollout_s"] for x in measured),
        "completion_tokens": statistics.fmean(x["completion_tokens"] for x in measured),
        "reward_mean": statistics.fmean(x["reward_mean"] for x in measured),
        "zero_std_groups": statistics.fmean(x["zero_std_groups"] for x in measured),
        "warmup_s": result["steps"][0]["step_s"] if warmup else float("nan"),
    }


def all_equal_groups(result: dict[str, Any], warmup: int) -> list[int]:
    """All-equal reward groups of each measured step (advantage 0 for the whole group)."""
    return [int(step["zero_std_groups"]) for step in result["steps"][warmup:]]


def refusal(s: Settings, ours: list[int], theirs: list[int]) -> str | None:
    """Why no ratio may be reported, or None: a measured step in which every group of a
    side had equal rewards did no update on that side (all advantages 0)."""
    for side, counts in (("looprl", ours), ("TRL", theirs)):
        for k, count in enumerate(counts, start=s.warmup + 1):
            if count >= s.tasks:
                return (
                    f"in measured step {k}, all {s.tasks} of {side}'s groups had equal rewards, "
                    "so its advantages were all 0 and that step made no update to compare; "
                    "rerun with more tasks, a larger group or longer answers"
                )
    return None


def print_report(s: Settings, ours: dict[str, Any], trl: dict[str, Any]) -> int:
    """The table and the RESULT line; returns the exit status (1: ratio refused)."""
    import torch
    import trl as trl_pkg

    a, b = side_summary(ours, s.warmup), side_summary(trl, s.warmup)
    checks = trl["checks"]
    same_tasks = [x["tasks"] for x in ours["steps"]] == [x["tasks"] for x in trl["steps"]]
    print(
        f"\nGSPO step, {s.model} fp32 LoRA r={s.lora_rank} on CPU ({torch.get_num_threads()} "
        f"threads), torch {torch.__version__}, trl {trl_pkg.__version__}\n"
        f"{s.tasks} tasks x {s.group} = {s.completions} completions/step, <= {s.max_new_tokens} "
        f"new tokens, {s.effective_updates} updates of {s.minibatch}, {ENV_NAME} "
        f"tool_choice={s.looprl_tool_choice} (looprl), auto (TRL); medians of {a['n']} steps "
        f"after {s.warmup} warm-up"
    )
    print(
        f"checks: prompt ids identical {checks['prompts_matching']}/{checks['prompts_checked']} "
        f"(mean {checks['prompt_tokens_mean']:.0f} tokens); same tasks every step: {same_tasks}; "
        f"eos ids looprl {checks['looprl_eos_ids']} trl {checks['trl_eos_ids']}"
    )
    print_table(a, b)
    ours_equal, trl_equal = all_equal_groups(ours, s.warmup), all_equal_groups(trl, s.warmup)
    print(
        f"all-equal reward groups per measured step (of {s.tasks}): looprl {ours_equal}, "
        f"TRL {trl_equal}"
    )
    if not (checks["prompt_ids_match"] and same_tasks):
        print("WARNING: the two sides did not see the same prompts; the ratio is not comparable")
    fields = {
        f"{side}_{key}": f"{summary[key]:.2f}"
        for key in ("step_s", "rollout_s", "update_s")
        for side, summary in (("looprl", a), ("trl", b))
    }
    fields["looprl_all_equal_groups"] = ",".join(map(str, ours_equal)) + f"_of_{s.tasks}"
    fields["trl_all_equal_groups"] = ",".join(map(str, trl_equal)) + f"_of_{s.tasks}"
    why = refusal(s, ours_equal, trl_equal)
    if why is not None:
        print(f"NO RATIO: {why}")
        print(result_line({"ratio": "refused", **fields}))
        return 1
    ratios = {
        f"{name}_time_ratio_vs_trl": f"{a[key] / b[key]:.3f}"
        for name, key in (("step", "step_s"), ("rollout", "rollout_s"), ("update", "update_s"))
    }
    step, rollout, update = ratios.values()
    print(f"looprl / TRL seconds: step {step}, rollout {rollout}, update {update}")
    print(result_line({**ratios, **fields}))
    return 0


def print_table(a: dict[str, float], b: dict[str, float]) -> None:
    """Per-side medians, with looprl / TRL for the timings."""
    rows = [
        ("step s (median)", "step_s", "{:.2f}"),
        ("  min / max", None, ""),
        ("  rollout s", "rollout_s", "{:.2f}"),
        ("  update s", "update_s", "{:.2f}"),
        ("warm-up step s", "warmup_s", "{:.2f}"),
        ("completion tokens", "completion_tokens", "{:.1f}"),
        ("reward mean", "reward_mean", "{:+.3f}"),
        ("all-equal groups", "zero_std_groups", "{:.1f}"),
    ]
    print(f"\n{'':<20} {'looprl':>12} {'TRL':>12} {'ratio':>7}")
    for label, key, fmt in rows:
        if key is None:
            left, right = f"{a['min_s']:.2f}/{a['max_s']:.2f}", f"{b['min_s']:.2f}/{b['max_s']:.2f}"
            print(f"{label:<20} {left:>12} {right:>12}")
            continue
        ratio = a[key] / b[key] if b[key] else float("nan")
        ratio_text = f"{ratio:.2f}" if key.endswith("_s") else ""
        print(f"{label:<20} {fmt.format(a[key]):>12} {fmt.format(b[key]):>12} {ratio_text:>7}")


def workload(s: Settings) -> dict[str, Any]:
    """What a saved TRL result must match to be reused: the env and every shared setting
    (looprl's tool choice aside, which TRL never sees)."""
    shared = {k: v for k, v in asdict(s).items() if k != "looprl_tool_choice"}
    return json.loads(json.dumps({"env": ENV_NAME, "env_args": ENV_ARGS, **shared}))


def reused_trl(path: Path, s: Settings) -> dict[str, Any]:
    """A TRL result saved by --save, refused unless it ran this workload and settings."""
    theirs = json.loads(path.read_text())
    saved = theirs.get("workload")
    if saved != workload(s):
        what = saved or "an earlier version of this benchmark (the tictactoe-move workload)"
        raise SystemExit(
            f"--reuse-trl {path} was saved for {what}, not for {workload(s)}; "
            "rerun without --reuse-trl (add --save to keep the new TRL result)"
        )
    return theirs


def main(argv: list[str] | None = None) -> None:
    s, args = parse_args(argv)
    theirs = reused_trl(args.reuse_trl, s) if args.reuse_trl else None
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        ours = run_side("looprl", s, Path(tmp))
        ours["workload"] = workload(s)
        if theirs is not None:
            print(f"\n=== trl: reusing {args.reuse_trl} ===")
        else:
            theirs = run_side("trl", s, Path(tmp))
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
        (args.save / f"looprl-{s.looprl_tool_choice}.json").write_text(json.dumps(ours))
        if not args.reuse_trl:
            (args.save / "trl.json").write_text(json.dumps(theirs))
    sys.exit(print_report(s, ours, theirs))


if __name__ == "__main__":
    main()
