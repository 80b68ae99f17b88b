"""The TRL side of bench/speed/step.py: `GRPOTrainer.train()` on the same tasks, prompts
and reward as the looprl side, timed per generation round. step.py runs it in a child
process and reads the JSON it writes:

    .venv/bin/python bench/speed/step_trl.py --result-json OUT.json [settings flags]

The settings and how each maps onto `GRPOConfig`, and what is timed, are in step.py's
docstring. The dataset is built from the env: step k takes `env.tasks("train", n=tasks,
seed=looprl.seeds.step_seed(seed, k))`, the tasks `looprl run` samples at step k.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from looprl.chat import ChatRenderer
from looprl.envs import make_env
from looprl.model.load import load_causal_lm, load_tokenizer
from looprl.seeds import step_seed
from looprl.types import Task

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.speed.step import (
    ENV_ARGS,
    ENV_NAME,
    Settings,
    ordered_unique,
    settings_from,
    settings_parser,
    workload,
)


def task_prompts(s: Settings, renderer: Any) -> list[dict[str, Any]]:
    """One dataset row per task per RL step, in looprl's order: the prompt text looprl
    renders, its ids, and the task itself (for the reward function)."""
    probe = make_env(ENV_NAME, ENV_ARGS)
    rows = []
    for step in range(1, s.rounds + 1):
        for task in probe.tasks("train", n=s.tasks, seed=step_seed(s.seed, step)):
            obs = make_env(ENV_NAME, ENV_ARGS).reset(task)
            rows.append({
                "prompt": renderer.render_text(obs.messages, obs.tools),
                "prompt_ids": renderer.prompt_ids(obs.messages, obs.tools),
                "task_id": task.id,
                "task_data": json.dumps(task.data),
                "task_seed": task.seed,
            })  # fmt: skip
    return rows


class RewardLog:
    """The TRL reward function: scores like looprl's rollout, and records per round the
    tasks, rewards, completion lengths and its own time."""

    __name__ = "looprl_env_reward"  # TRL names reward functions by __name__

    def __init__(self, renderer: Any, group: int, max_tokens: int) -> None:
        self.renderer = renderer
        self.group = group
        self.max_tokens = max_tokens
        self.rounds: list[dict[str, Any]] = []

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        completion_ids: list[list[int]],
        task_id: list[str],
        task_data: list[str],
        task_seed: list[int],
        **_: Any,
    ) -> list[float]:
        start = time.perf_counter()
        rewards = [
            self.score(ids, tid, data, seed)
            for ids, tid, data, seed in zip(completion_ids, task_id, task_data, task_seed)
        ]
        self.rounds.append({
            "tasks": ordered_unique(task_id),
            "reward_mean": statistics.fmean(rewards),
            "completion_tokens": statistics.fmean(len(ids) for ids in completion_ids),
            "zero_std_groups": self.zero_std_groups(rewards),
            "reward_s": time.perf_counter() - start,
        })  # fmt: skip
        return rewards

    def zero_std_groups(self, rewards: list[float]) -> int:
        """Groups whose rewards are all equal (advantage 0 for every completion). TRL's
        sampler repeats each prompt `group` times in a row, so groups are consecutive."""
        groups = [rewards[i : i + self.group] for i in range(0, len(rewards), self.group)]
        return sum(len(set(g)) == 1 for g in groups)

    def score(self, ids: list[int], task_id: str, data: str, seed: int) -> float:
        """What looprl's rollout does with a completion, for a one-turn env: a reply that
        the token limit cut (no end-of-turn token) scores the env's lowest reward unless it
        holds a whole valid call (loop/rollout.py); any other reply is the env's to score."""
        env = make_env(ENV_NAME, ENV_ARGS)
        obs = env.reset(Task(id=task_id, data=json.loads(data), seed=seed))
        message = self.renderer.assistant_message(
            self.renderer.decode(ids),
            obs.tools,
            require_call=bool(obs.tools) and obs.tool_choice != "none",
        )
        cut = len(ids) >= self.max_tokens and not (ids and ids[-1] in self.renderer.eos_ids)
        if cut and not (message.tool_calls and not message.parse_failure):
            return float(env.reward_range[0])
        return float(env.step(message).reward)


def round_timer(updates: int) -> Any:
    """A TrainerCallback timing each generation round: `updates` optimizer steps."""
    from transformers import TrainerCallback

    class RoundTimer(TrainerCallback):
        def __init__(self) -> None:
            self.begin = 0.0
            self.rounds: list[float] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step % updates == 0:  # the first optimizer step of a round
                self.begin = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step % updates == 0:  # global_step already counts this one
                self.rounds.append(time.perf_counter() - self.begin)

    return RoundTimer()


def timed_trainer_class() -> type:
    """GRPOTrainer whose `_generate` (tokenize, generate, decode) is timed: the rollout
    share of a round. Nothing else changes."""
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        generate_s: list[float]

        def _generate(self, prompts: list) -> Any:
            start = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                self.generate_s.append(time.perf_counter() - start)

    return TimedGRPOTrainer


def trl_config(s: Settings, output_dir: str) -> Any:
    """GRPOConfig for GSPO with the shared settings (mapping in the module docstring)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir, use_cpu=True, bf16=False, fp16=False, use_vllm=False,
        seed=s.seed, data_seed=s.seed, shuffle_dataset=False,
        learning_rate=s.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim="adamw_torch", max_grad_norm=1.0,
        per_device_train_batch_size=s.minibatch, gradient_accumulation_steps=1,
        steps_per_generation=s.effective_updates, num_iterations=1,
        max_steps=s.rounds * s.effective_updates,
        num_generations=s.group, max_completion_length=s.max_new_tokens,
        temperature=s.temperature, top_p=s.top_p, top_k=0,
        beta=0.0, epsilon=s.eps_low, epsilon_high=s.eps_high,
        importance_sampling_level="sequence", loss_type="grpo", scale_rewards="group",
        mask_truncated_completions=False, gradient_checkpointing=False, disable_dropout=True,
        logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_pin_memory=False, remove_unused_columns=False,
    )  # fmt: skip


def run_trl(s: Settings) -> dict[str, Any]:
    """GRPOTrainer.train() for `rounds` generation rounds, timed per round."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig

    tokenizer = load_tokenizer(s.model)
    model = load_causal_lm(s.model, torch.float32)
    renderer = ChatRenderer(tokenizer, model_name=s.model)
    rows = task_prompts(s, renderer)
    dataset = Dataset.from_list([{k: v for k, v in r.items() if k != "prompt_ids"} for r in rows])
    reward = RewardLog(renderer, s.group, s.max_new_tokens)
    timer = round_timer(s.effective_updates)
    lora = LoraConfig(
        r=s.lora_rank, lora_alpha=s.lora_alpha, lora_dropout=s.lora_dropout,
        target_modules="all-linear", task_type="CAUSAL_LM",
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as tmp:
        trainer = timed_trainer_class()(
            model=model, reward_funcs=[reward], args=trl_config(s, tmp), train_dataset=dataset,
            processing_class=tokenizer, peft_config=lora, callbacks=[timer],
        )  # fmt: skip
        trainer.generate_s = []
        checks = trl_checks(trainer, rows, renderer)
        trainer.train()
    steps = [
        {
            "step_s": seconds,
            "rollout_s": generate + scored["reward_s"],
            "reward_mean": scored["reward_mean"],
            "completion_tokens": scored["completion_tokens"],
            "zero_std_groups": scored["zero_std_groups"],
            "tasks": scored["tasks"],
        }
        for seconds, generate, scored in zip(timer.rounds, trainer.generate_s, reward.rounds)
    ]
    return {"steps": steps, "updates": s.effective_updates, "checks": checks}


def trl_checks(trainer: Any, rows: list[dict[str, Any]], renderer: Any) -> dict[str, Any]:
    """TRL's own prompt tokenization vs looprl's ids, and its stop tokens vs looprl's."""
    texts = [r["prompt"] for r in rows]
    trl_ids = [list(map(int, ids)) for ids in trainer._tokenize_prompts(texts)[0]]
    same = sum(a == r["prompt_ids"] for a, r in zip(trl_ids, rows))
    return {
        "prompt_ids_match": same == len(rows),
        "prompts_checked": len(rows),
        "prompts_matching": same,
        "prompt_tokens_mean": statistics.fmean(len(r["prompt_ids"]) for r in rows),
        "trl_eos_ids": list(trainer.eos_token_ids),
        "looprl_eos_ids": list(renderer.eos_ids),
    }


def main() -> None:
    parser = settings_parser(__doc__)
    parser.add_argument("--result-json", type=Path, required=True, help="where to write the result")
    args = parser.parse_args()
    s = settings_from(args, parser)
    result = run_trl(s)
    result["workload"] = workload(s)
    args.result_json.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
