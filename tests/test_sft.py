"""SFT warm start: demonstrations become exact token sequences with assistant-only loss
masks, and a short SFT stage teaches a tiny model a tool call it could not make."""

from __future__ import annotations

import io
import json

from rich.console import Console

from looprl.config import config_from_dict
from looprl.envs.builtin.tictactoe import TicTacToeMove, score_move
from looprl.loop.progress import Progress
from looprl.loop.sft import demo_episode
from looprl.loop.train import run_training


def test_demo_episode_tokens_and_mask(renderer, tokenizer):
    env = TicTacToeMove(tool_choice="auto")
    task = env.tasks("train", n=1, seed=5)[0]
    episode = demo_episode(env, task, renderer)
    generated = [t for t, m in zip(episode.token_ids, episode.loss_mask) if m]
    assert generated[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = tokenizer.decode(generated, skip_special_tokens=True)
    call = renderer.parse(text, env.reset(task).tools)
    assert call.failure is None
    assert episode.reward == score_move(task.data["board"], call.calls[0].arguments["square"])
    assert episode.reward >= 0.8
    # the masked tokens are exactly the tail after the prompt
    prompt = renderer.prompt_ids(env.reset(task).messages, env.reset(task).tools)
    assert episode.token_ids[: len(prompt)] == prompt
    assert episode.loss_mask == [0] * len(prompt) + [1] * (len(episode.token_ids) - len(prompt))


def test_sft_teaches_a_free_form_tool_call(tmp_path):
    cfg = {
        "model": {"name": "tiny-random", "tool_format": "llama3", "lora": {"enabled": False}},
        "env": {"name": "toy_envs:PickSeven", "args": {"tool_choice": "auto"}},
        "sft": {"enabled": True, "steps": 100, "batch_size": 4, "lr": 1e-2},
        "rollout": {"tasks_per_step": 2, "group_size": 4, "max_new_tokens": 24},
        "train": {"steps": 1, "checkpoint_every": 0},
        "eval": {"tasks": 4, "samples_per_task": 1, "temperature": 0.0},
        "logging": {"tensorboard": False},
    }
    run = tmp_path / "run"
    shown = io.StringIO()
    progress = Progress(console=Console(file=shown, width=200))
    result = run_training(config_from_dict(cfg), run, progress=progress)
    after_sft = json.loads((run / "eval" / "after_sft.json").read_text())
    assert result["baseline"]["valid_tool_call_rate"] < 0.2
    assert after_sft["valid_tool_call_rate"] > 0.8
    assert after_sft["reward_mean"] > result["baseline"]["reward_mean"] + 0.5
    losses = [
        json.loads(x)["sft/loss"] for x in (run / "sft_metrics.jsonl").read_text().splitlines()
    ]
    assert losses[-1] < losses[0] / 2
    report = (run / "report.md").read_text()
    assert "| metric | before | after SFT | after |" in report
    # the before/after plot has the after-SFT bar between them
    assert "![Held-out reward before, after SFT and after, and the paired difference]" in report
    starts = [line for line in shown.getvalue().splitlines() if line.startswith("▶ ")]
    assert starts == [
        "▶ load model",
        "▶ baseline eval (4 episodes)",
        "▶ SFT warm start (100 steps)",
        "▶ eval after SFT (4 episodes)",
        "▶ training (1 step)",
        "▶ final eval (4 episodes)",
        "▶ write report",
    ]
    assert result["after_sft"] == after_sft


def test_free_tokens_of_a_forced_call_are_the_decision(renderer, tokenizer):
    # sft.loss_on=free: of the forced choose_square call only the square's digit is free
    from looprl.engine.grammar import GrammarCache

    grammars = GrammarCache(
        tokenizer, len(tokenizer), [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    )
    env = TicTacToeMove(tool_choice="required")
    for seed in (5, 6, 7):
        task = env.tasks("train", n=1, seed=seed)[0]
        every = demo_episode(env, task, renderer)
        free = demo_episode(env, task, renderer, grammars)
        assert free.token_ids == every.token_ids and free.reward == every.reward
        picked = [t for t, m in zip(free.token_ids, free.loss_mask) if m]
        square = env.demonstrations(task)[0].tool_calls[0].arguments["square"]
        assert tokenizer.decode(picked) == str(square)
        assert sum(every.loss_mask) > 20  # the whole scaffold, for comparison
    # free tool choice: no grammar, every assistant token counts
    env = TicTacToeMove(tool_choice="auto")
    task = env.tasks("train", n=1, seed=5)[0]
    assert (
        demo_episode(env, task, renderer, grammars).loss_mask
        == demo_episode(env, task, renderer).loss_mask
    )


def test_greedy_eval_after_sft(tmp_path):
    """With eval.greedy, the SFT weights are evaluated greedily too: the report's greedy
    table gets an "after SFT" column. With no RL step after it, the final greedy eval is
    of the same weights and must match it episode for episode."""
    cfg = {
        "model": {"name": "tiny-random", "lora": {"enabled": False}},
        "env": {"name": "tictactoe-move"},
        "sft": {"enabled": True, "steps": 2, "batch_size": 2, "lr": 1e-3, "loss_on": "free"},
        "rollout": {"tasks_per_step": 2, "group_size": 2, "max_new_tokens": 40},
        "train": {"steps": 0, "checkpoint_every": 0},
        "eval": {"tasks": 3, "samples_per_task": 2, "temperature": 1.0, "greedy": True},
        "logging": {"trackers": []},
    }
    run = tmp_path / "run"
    shown = io.StringIO()
    run_training(config_from_dict(cfg), run, progress=Progress(console=Console(file=shown)))
    mid = json.loads((run / "eval" / "after_sft_greedy.json").read_text())
    final = json.loads((run / "eval" / "final_greedy.json").read_text())
    base = json.loads((run / "eval" / "baseline_greedy.json").read_text())
    assert mid["temperature"] == 0.0 and mid["n"] == 3 * 2  # greedy: as many tasks as episodes
    assert mid["task_ids"] == base["task_ids"] == final["task_ids"]
    assert mid["rewards"] == final["rewards"]
    assert "▶ greedy eval after SFT (6 episodes)" in shown.getvalue()
    # not a terminal: a line per SFT step, the time left on all but the last
    sft_lines = [x for x in shown.getvalue().splitlines() if x.startswith("  SFT warm start · ")]
    assert len(sft_lines) == 2 and "· ETA " in sft_lines[0] and "ETA" not in sft_lines[1]
    assert sft_lines[1].startswith("  SFT warm start · 2/2 steps · loss ")
    greedy = (run / "report.md").read_text().split("## Greedy policy (T = 0)")[1]
    assert "| metric | before | after SFT | after |" in greedy.split("##")[0]


def test_sft_env_args_choose_the_demonstration_tasks(tmp_path, monkeypatch):
    """sft.env_args override env.args for the warm start's tasks only: here every
    demonstration game is played as O, while the RL steps and evals alternate sides."""
    import looprl.loop.sft as sft

    seen = []
    real = sft.demo_episode

    def recording(env, task, renderer, grammars=None):
        seen.append((env.agent_plays, task.data["agent"]))
        return real(env, task, renderer, grammars)

    monkeypatch.setattr(sft, "demo_episode", recording)
    cfg = {
        "model": {"name": "tiny-random"},
        "env": {"name": "tictactoe-game", "args": {"opponent": "random"}},
        "sft": {"enabled": True, "steps": 2, "batch_size": 3, "env_args": {"agent_plays": "O"}},
        "rollout": {"tasks_per_step": 2, "group_size": 2, "max_new_tokens": 32},
        "train": {"steps": 1, "checkpoint_every": 0},
        "eval": {"tasks": 2, "samples_per_task": 1, "greedy": False},
        "logging": {"trackers": []},
    }
    run = tmp_path / "run"
    run_training(config_from_dict(cfg), run)
    assert seen == [("O", "O")] * 6
    # the evals keep env.args: the agent alternates sides (even games X, odd ones O)
    baseline = json.loads((run / "eval" / "baseline.json").read_text())
    assert {int(t.rsplit("-", 1)[1]) % 2 for t in baseline["task_ids"]} <= {0, 1}
    assert all(t.startswith("game-eval-") for t in baseline["task_ids"])
    assert (run / "config.yaml").read_text().count("agent_plays: O") == 1
