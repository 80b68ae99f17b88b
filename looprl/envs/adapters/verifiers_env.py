"""A verifiers environment as a looprl environment (`env.name: verifiers:<module[:name]>`).

    env:
      name: verifiers:my_tasks            # a module exporting a vf.Taskset (or my_tasks:Class)
      args:
        config: {num_tasks: 200}          # the taskset's config fields
        eval_fraction: 0.1                # the seeded held-out share (split_seed)

verifiers pins `openai<3`, which cannot share looprl's environment, so it runs in a worker
process of its own Python (`.venv-verifiers`, `make setup-verifiers`; or `python:`), one
per environment spec, shared by all episodes and started again if it dies; it imports the
module from the folder looprl runs in. It loads the tasks, lists and runs their tools and
computes every reward function on the finished conversation (verifiers_worker/worker.py).

An episode: the task's system prompt and prompt open it; without tools the reply is scored
and it ends; with tools each call is run by the worker and answered as a tool message,
until a reply without a call (that reply ends it) or `max_turns` (scored as it stands,
outcome `max_turns`). The reward is the weighted sum of the reward functions, each in
[0, 1]: reward_range is [sum of the negative weights, sum of the positive ones]. Each
function's score is in `info["scores"]` (logged as `scores/<fn>`), its weight in
`info["weights"]`. Outcomes: `correct` (the highest reward), `partial`, `wrong` (no
credit from any positive weight), and with tools `max_turns` and the malformed calls,
which earn `failure_reward` (by default the bottom of the range).

What the worker cannot honour (a task needing a container or a remote sandbox, a toolset
served elsewhere, judge plugins, a dataset fetched from the Hugging Face hub) is one EnvError
naming it; so is a worker that dies, hangs past `timeout_s` or answers with an error, with
the tail of its stderr.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import queue
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any, ClassVar

from looprl import children
from looprl.envs.common import (
    Adapter,
    check_choice,
    check_fraction,
    check_int,
    in_progress,
    reward_label,
    sample_items,
    unscored,
)
from looprl.errors import EnvError
from looprl.types import PARSE_FAILURES, Message, Observation, StepResult, Task

INSTALL = "make setup-verifiers"
WORKER = Path(__file__).parent / "verifiers_worker" / "worker.py"
REPO = Path(__file__).resolve().parents[3]


VENVS = {"v1": ".venv-verifiers", "classic": ".venv-verifiers-classic"}


def find_python(python: str | None, api: str = "v1") -> str:
    """`python`, else the API's venv (`.venv-verifiers`, or `.venv-verifiers-classic` for
    the classic API; here or in looprl's checkout), else (v1) this Python when it has
    verifiers; else a clear EnvError naming the install."""
    if python:
        if not Path(python).is_file():
            raise EnvError(
                f"verifiers: env.args.python={python!r} does not exist; "
                f"install verifiers' environment with `{INSTALL}`"
            )
        return python
    for root in (Path.cwd(), REPO):
        candidate = root / VENVS[api] / "bin" / "python"
        if candidate.is_file():
            return str(candidate)
    if api == "v1" and importlib.util.find_spec("verifiers") is not None:
        return sys.executable
    raise EnvError(
        f"verifiers ({api} API) is not installed: run `{INSTALL}` (it makes {VENVS[api]}: "
        "verifiers pins openai<3, which cannot share looprl's environment), or point "
        "env.args.python at a Python that has it"
    )


class _Worker:
    """One worker process: requests written to its stdin, replies read from its stdout by
    a thread (so every wait has a timeout), its stderr kept in a file for error messages."""

    def __init__(self, command: list[str], start_timeout_s: float) -> None:
        self.log = Path(tempfile.mkstemp(prefix="looprl-verifiers-", suffix=".log")[1])
        env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
        self.process = children.start(
            command,
            self.log,
            merge_stdout=False,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.lock = threading.Lock()
        self.next_id = 0
        self.info = self._result(self._reply(start_timeout_s, "loading the environment"), "load")

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.replies.put(line)
        self.replies.put(None)

    def alive(self) -> bool:
        return self.process.poll() is None

    def request(self, op: str, timeout_s: float, **params: Any) -> dict[str, Any]:
        with self.lock:
            if not self.alive():
                raise self._gone(f"before {op}")
            self.next_id += 1
            assert self.process.stdin is not None
            try:
                self.process.stdin.write(
                    json.dumps({"id": self.next_id, "op": op, **params}) + "\n"
                )
                self.process.stdin.flush()
            except OSError:
                raise self._gone(f"taking {op}") from None
            reply = self._reply(timeout_s, op)
            if reply.get("id") != self.next_id:
                self.close()
                raise EnvError(f"the verifiers worker answered out of turn: {reply}\n{self.tail()}")
        return self._result(reply, op)

    def _reply(self, timeout_s: float, what: str) -> dict[str, Any]:
        try:
            line = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            self.close()
            raise EnvError(
                f"the verifiers worker did not answer {what} within {timeout_s:.0f} s "
                f"(env.args.timeout_s); it was stopped and starts again for the next "
                f"episode\n{self.tail()}"
            ) from None
        if line is None:
            raise self._gone(f"during {what}")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            self.close()
            raise EnvError(f"the verifiers worker wrote {line[:200]!r}\n{self.tail()}") from None

    def _result(self, reply: dict[str, Any], op: str) -> dict[str, Any]:
        if reply.get("ok"):
            return reply["result"]
        if reply.get("unsupported"):
            raise EnvError(f"verifiers: {reply['error']}")
        raise EnvError(f"the verifiers worker failed on {op}:\n{reply['error']}\n{self.tail()}")

    def _gone(self, when: str) -> EnvError:
        code = self.process.wait()
        return EnvError(
            f"the verifiers worker exited (code {code}) {when}; it starts again "
            f"for the next episode\n{self.tail()}"
        )

    def tail(self, lines: int = 15) -> str:
        text = children.log_lines(self.log, lines)
        return "\n".join(["worker stderr (last lines):", *text, f"(whole log: {self.log})"])

    def close(self) -> None:
        children.stop(self.process)


_WORKERS: children.Children[_Worker] = children.Children(_Worker.close)


def worker_for(python: str, target: str, spec: dict[str, Any], start_timeout_s: float) -> _Worker:
    """The live worker for this environment spec, started (again) when there is none."""
    key = (python, target, json.dumps(spec, sort_keys=True))
    command = [
        python,
        str(WORKER),
        "--target",
        target,
        "--args",
        json.dumps(spec["config"]),
        "--eval-fraction",
        str(spec["eval_fraction"]),
        "--split-seed",
        str(spec["split_seed"]),
    ]
    return _WORKERS.get(key, lambda: _Worker(command, start_timeout_s), _Worker.alive)
    _WORKERS.clear()


class Verifiers(Adapter):
    """A verifiers environment, played through a worker in verifiers' own Python."""

    prefix: ClassVar[str] = "verifiers"
    target_help: ClassVar[str] = "<module[:Class]>"
    description: ClassVar[str] = (
        "A verifiers environment (a v1 Taskset, or with api: classic a 0.1.x "
        "vf.Environment) run in verifiers' own Python; every reward function is a score."
    )
    solved_outcomes: ClassVar[tuple[str, ...]] = ("correct",)

    def __init__(
        self,
        config: dict[str, Any] | None = None,
        python: str | None = None,
        api: str = "v1",
        eval_fraction: float = 0.1,
        split_seed: int = 0,
        max_turns: int = 10,
        tool_choice: str = "auto",
        failure_reward: float | None = None,
        timeout_s: float = 120.0,
        start_timeout_s: float = 600.0,
    ) -> None:
        check_fraction("eval_fraction", eval_fraction)
        for name, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
            if not isinstance(value, int | float) or not value > 0:
                raise EnvError(f"{name}={value!r} is invalid: expected seconds > 0")
        if config is not None and not isinstance(config, dict):
            raise EnvError(f"config={config!r} is invalid: expected the taskset's fields")
        # "required": every turn calls a tool (a taskset that answers through a tool); the
        # episode then ends at max_turns, scored as it stands
        self.tool_choice = check_choice("tool_choice", tool_choice, ("auto", "required"))
        self.api = check_choice("api", api, tuple(VENVS))
        self.python = find_python(python, self.api)
        self.spec = {
            "config": config or {},
            "eval_fraction": float(eval_fraction),
            "split_seed": check_int("split_seed", split_seed),
        }
        self.timeout_s, self.start_timeout_s = float(timeout_s), float(start_timeout_s)
        info = self._worker().info
        if info["api"] != self.api:
            raise EnvError(
                f"verifiers: {self.python} has verifiers' {info['api']} API, not "
                f"the {self.api} API that env.args.api names"
            )
        self.weights: dict[str, float] = info["weights"]
        self.has_tools: bool = info["tools"]
        if not self.weights:
            raise EnvError(f"verifiers: {self.target} defines no reward function")
        self.best = sum(w for w in self.weights.values() if w > 0)
        low = sum(w for w in self.weights.values() if w < 0)
        self.failure_reward = low if failure_reward is None else float(failure_reward)
        self.reward_range = (min(low, self.failure_reward), self.best)
        self.max_turns = check_int("max_turns", max_turns, 1) if self.has_tools else 1
        self.outcomes = ("correct", "partial", "wrong") + (
            ("max_turns", *(f for f in PARSE_FAILURES if f != "no_tool_call"))
            if self.has_tools
            else ()
        )
        # a reward function may give only 0 or 1: `partial` may never occur (envs check)
        self.uncertain_outcomes = ("partial",)
        self.splits = {s: [Task(str(t["index"]), t) for t in info[s]] for s in ("train", "eval")}
        self._episode: str | None = None
        self._history: list[Message] = []
        self._turns = 0

    def _worker(self) -> _Worker:
        return worker_for(self.python, self.target, self.spec, self.start_timeout_s)

    # ------------------------------------------------------------------ protocol

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list[Task]:
        """Eval: every held-out task, or a seeded sample of `n`. Train: `n` tasks (all when
        n is None), every task used before any is repeated."""
        if split not in self.splits:
            raise EnvError(f"verifiers: split={split!r} is invalid: expected train or eval")
        pool = self.splits[split]
        return (
            list(pool)
            if split == "eval" and (n is None or n >= len(pool))
            else sample_items(pool, n, seed)
        )

    def reset(self, task: Task) -> Observation:
        self._episode = uuid.uuid4().hex
        opened = self._worker().request(
            "reset", self.timeout_s, episode=self._episode, index=task.data["index"]
        )
        self._history = [Message(m["role"], m["content"]) for m in opened["messages"]]
        self._tools: list[dict[str, Any]] = opened["tools"]
        self._turns = 0
        choice = self.tool_choice if self._tools else "none"
        return Observation(list(self._history), tools=self._tools, tool_choice=choice)

    def step(self, message: Message) -> StepResult:
        in_progress("verifiers", self._episode)
        self._turns += 1
        self._history.append(message)
        failure = message.parse_failure
        if self._tools and failure is not None and failure != "no_tool_call":
            self._episode = None
            return unscored(message, failure, self.failure_reward)
        if not (self._tools and message.tool_calls and failure is None):
            return self._finish("agent_completed")  # a reply without a call ends it
        if self._turns >= self.max_turns:
            return self._finish("max_turns")
        answers = []
        for j, call in enumerate(message.tool_calls):
            call.id = call.id or f"call_{self._turns}_{j}"
            result = self._worker().request(
                "call",
                self.timeout_s,
                episode=self._episode,
                name=call.name,
                arguments=call.arguments,
            )
            answers.append(Message("tool", result["content"], tool_call_id=call.id, name=call.name))
        self._history += answers
        return StepResult(answers, done=False)

    def demonstrations(self, task: Task) -> list[Message]:
        """The task's `answer` as the reply, where its data has one and it has no tools (a
        tool episode's calls are not in the data)."""
        if self.has_tools or "answer" not in task.data:
            return []
        return [Message("assistant", task.data["answer"])]

    # ------------------------------------------------------------------ scoring

    def _finish(self, stop: str) -> StepResult:
        episode, self._episode = self._episode, None
        scored = self._worker().request(
            "score",
            self.timeout_s,
            episode=episode,
            stop=stop,
            messages=[m.to_dict() for m in self._history],
        )
        scores = self._checked(scored["rewards"])
        reward = sum(self.weights[name] * value for name, value in scores.items())
        reward = min(max(reward, self.reward_range[0]), self.reward_range[1])  # float rounding
        credit = sum(self.weights[n] * v for n, v in scores.items() if self.weights[n] > 0)
        solved = math.isclose(reward, self.best)
        outcome = "max_turns" if stop == "max_turns" else reward_label(credit, solved)
        info: dict[str, Any] = {"scores": scores, "weights": dict(self.weights)}
        if scored["metrics"]:
            info["metrics"] = scored["metrics"]
        return StepResult([], done=True, reward=reward, outcome=outcome, info=info)

    def _checked(self, rewards: dict[str, Any]) -> dict[str, float]:
        """Each reward function's score, checked against the declared weights and [0, 1]."""
        scores = {}
        for name, scored in rewards.items():
            if scored is None:
                raise EnvError(f"verifiers: reward {name} was not scored")
            value, weight = scored
            if self.weights.get(name) != weight:
                raise EnvError(
                    f"verifiers: reward {name} has weight {weight}, not the "
                    f"{self.weights.get(name)} its first task declared"
                )
            if not (isinstance(value, int | float) and 0 <= value <= 1):
                raise EnvError(
                    f"verifiers: reward {name} gave {value!r}; looprl takes each "
                    "reward function's score in [0, 1] (its reward_range is "
                    "the sums of the weights)"
                )
            scores[name] = float(value)
        missing = set(self.weights) - set(scores)
        if missing:
            raise EnvError(f"verifiers: rewards {sorted(missing)} were not scored")
        return scores
