"""Multi-turn rollouts with and without keeping each episode's KV between turns.

    .venv/bin/python bench/speed/sessions.py [--tasks 16] [--group 4] [--repeats 2]

Plays `tictactoe-game` (whole games against the scripted opponent: up to 5 model turns,
a forced `choose_square` call each turn) with SmolLM2-135M in float32, through the
rollout loop `looprl run` uses (`looprl.loop.rollout.run_episodes`), twice per repeat with
the same tasks and seeds:

- **session**: the engine keeps each finished row's KV for the episode's next turn,
  which then prefills only the tool result and the new turn's header;
- **re-prefill**: the same engine without `session()`: every turn prefills the whole
  history (prefix sharing still applies).

Prints wall-clock seconds (median of the repeats, the two interleaved), the tokens the
model ran (prefill + decode, counted by a forward hook), whether both produced the same
episodes token for token, and ends with

    RESULT session_speedup=X session_s=Y reprefill_s=Z
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

import torch

from looprl.chat import ChatRenderer
from looprl.engine import SamplingParams
from looprl.engine.hf import HFEngine
from looprl.envs import make_env
from looprl.loop.rollout import run_episodes
from looprl.model.load import load_causal_lm, load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import arguments, median, result_line


class WithoutSession:
    """The engine minus `session()`: the rollout loop then re-prefills every turn."""

    def __init__(self, engine: HFEngine) -> None:
        self.generate = engine.generate


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    model = load_causal_lm(args.model, torch.float32).eval()
    renderer = ChatRenderer(tokenizer, model_name=args.model)
    engine = HFEngine(model, tokenizer, renderer.eos_ids, batch_size=64)
    env = make_env("tictactoe-game")
    tasks = [t for t in env.tasks("train", n=args.tasks, seed=3) for _ in range(args.group)]
    params = SamplingParams(temperature=1.0, max_new_tokens=64, seed=11)
    fed = [0]
    model.register_forward_hook(
        lambda m, a, kw, out: fed.__setitem__(0, fed[0] + kw["input_ids"].numel()),
        with_kwargs=True,
    )

    def play(runner) -> tuple[float, int, list]:
        fed[0] = 0
        start = time.perf_counter()
        episodes = run_episodes(
            tasks,
            partial(make_env, "tictactoe-game"),
            runner,
            renderer,
            params,
            env.max_turns,
            4096,
        )
        return time.perf_counter() - start, fed[0], episodes

    play(WithoutSession(engine))  # warm-up
    times: dict[str, list[float]] = {"session": [], "re-prefill": []}
    tokens: dict[str, int] = {}
    same = True
    for _ in range(args.repeats):
        seconds, ran, kept = play(engine)
        times["session"].append(seconds)
        tokens["session"] = ran
        seconds, ran, plain = play(WithoutSession(engine))
        times["re-prefill"].append(seconds)
        tokens["re-prefill"] = ran
        same &= [e.token_ids for e in kept] == [e.token_ids for e in plain]
    turns = sum(len(e.turns) for e in kept)
    print(f"{len(tasks)} episodes, {turns} model turns; {torch.get_num_threads()} threads")
    print(f"{'':>11} {'seconds':>8} {'tokens run':>11}")
    for name in times:
        print(f"{name:>11} {median(times[name]):>8.1f} {tokens[name]:>11}")
    print(f"same episodes token for token: {same}")
    a, b = median(times["session"]), median(times["re-prefill"])
    print(result_line({"session_speedup": f"{b / a:.2f}", "session_s": f"{a:.1f}",
                       "reprefill_s": f"{b:.1f}"}))  # fmt: skip


if __name__ == "__main__":
    main()
