"""An MCP tool server's tools as an environment (`mcp`).

    env:
      name: mcp
      args:
        server: "python examples/mcp_shop/server.py"   # a command (stdio) or http(s)://.../mcp
        tasks: examples/mcp_shop/tasks.jsonl            # eval_path, or a seeded eval_fraction
        isolation: reset                                # shared | reset | fresh
        max_turns: 6

At reset the server's tools (as `list_tools` gives them, input schemas untouched) are the
episode's tools, tool_choice "auto". Each call the model makes runs on the server and its
result comes back as a tool message (text content joined, or the structured content as
JSON); a result marked `isError` comes back the same way (the model may recover; counted
in `info["tool_errors"]`). A reply without a call is the final answer: the episode is
scored and ends. With `answer_tool: answer` every reply is a call, forced by the grammar
(tool_choice "required"; the schemas must compile, which the run checks before the model
loads), and a call of that tool, which looprl adds, is the final answer. A reply that still
calls tools at the `max_turns`-th turn ends it too,
scored with an empty answer, outcome `turn_limit`. A malformed call (`bad_json`,
`unknown_tool`, `bad_arguments`) ends it with `failure_reward` (-1).

Task rows (JSONL, CSV or Parquet): `prompt` or `messages`, optional `system` and `info`
(an object), and at least one way to score, each a score in [0, 1]:
- `answer`: the final answer's text against it, by `scorers` (envs/data/scorers.py; default
  `normalized`; a `judge` works too);
- `expected_calls`: [{name, arguments}]: each expected call earns the per-field credit of
  the best made call of that name (the `tool_call` scorer; each made call matched once,
  in any order); the credit is divided by the expected calls plus the unmatched calls of
  an expected call's name (so calling the graded tool over and over does not pay, while
  lookups with other tools cost nothing);
- `score_tool`: a tool of the server, hidden from the model, called after the episode on
  the episode's own server with `{"answer": <final text>, "info": <the row's info>}`; it
  returns a number in [0, 1] (as text, or structured `{"result": x}`).
The reward is the mean of the row's scores. Outcomes: `correct` (reward 1), `partial`,
`wrong` (0), `turn_limit`, and the parse failures; each score is in `info["scores"]`.

Isolation (mcp_client.py): `shared` (one server for all episodes), `reset` (a pool of
servers, one per live episode, `reset_tool` called as each episode starts; the reset tool
is hidden from the model) or `fresh` (a new server per episode). For a URL a "server" is
a session. Faults: a server that will not start or list its tools is an EnvError when the
env is made (the preflight reports it, with the server's stderr, before the model
loads); bad rows name the file, the row and the field; a call that runs past
`call_timeout_s`, or a server that dies, raises from `step` (the rollout counts the
episode `env_error`) and that server is replaced for the next episode.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar

from looprl.envs.adapters import mcp_client
from looprl.envs.adapters.mcp_tasks import answer_score, checked_tasks
from looprl.envs.common import (
    check_choice,
    check_failure_reward,
    check_fraction,
    check_int,
    in_progress,
    reward_label,
    sample_items,
    unscored,
)
from looprl.envs.data.score_types import as_text
from looprl.envs.data.scorers import make_scorers, make_tool_call
from looprl.errors import EnvError
from looprl.types import Message, Observation, StepResult, Task, ToolCall

ALL_OR_NOTHING = ("exact", "normalized", "numeric", "regex", "contains")
FAILURES = ("bad_json", "unknown_tool", "bad_arguments")  # no_tool_call is the final answer
_call_credit = make_tool_call()


@dataclass
class _Episode:
    task: Task
    conn: mcp_client.Connection
    release: weakref.finalize  # gives the connection back, once (also when the env is dropped)
    calls: list[dict[str, Any]] = field(default_factory=list)
    tool_errors: int = 0
    turns: int = 0


class McpTools:
    """The tools of an MCP server, tasks from a file (module docstring)."""

    name: ClassVar[str] = "mcp"
    description: ClassVar[str] = "An MCP server's tools (stdio command or URL), tasks from a file."
    solved_outcomes: ClassVar[tuple[str, ...]] = ("correct",)
    needs_args: ClassVar[str] = "server=COMMAND_OR_URL tasks=FILE"
    # the arguments that name files: a config's are looked up in its folder first
    path_args: ClassVar[tuple[str, ...]] = ("tasks", "eval_path")

    def __init__(
        self,
        server: str | None = None,
        tasks: str | None = None,
        eval_path: str | None = None,
        eval_fraction: float = 0.1,
        split_seed: int = 0,
        isolation: str = "fresh",
        reset_tool: str = "reset",
        max_turns: int = 6,
        call_timeout_s: float = 10.0,
        system_prompt: str | None = None,
        tools: list[str] | None = None,
        scorers: Any = "normalized",
        failure_reward: float = -1.0,
        answer_tool: str | None = None,
    ) -> None:
        spec = mcp_client.check_command(server)
        if not tasks:
            raise EnvError("mcp: env.args.tasks is required (a .jsonl, .csv or .parquet file)")
        check_fraction("eval_fraction", eval_fraction)
        check_failure_reward(failure_reward)
        if (
            isinstance(call_timeout_s, bool)
            or not isinstance(call_timeout_s, int | float)
            or not call_timeout_s > 0
        ):
            raise EnvError(f"call_timeout_s={call_timeout_s!r} is invalid: expected seconds > 0")
        if tools is not None and not (
            isinstance(tools, list) and all(isinstance(t, str) for t in tools)
        ):
            raise EnvError(f"tools={tools!r} is invalid: expected a list of tool names")
        self.isolation = check_choice("isolation", isolation, mcp_client.ISOLATIONS)
        self.max_turns = check_int("max_turns", max_turns, 1)
        self.call_timeout_s = float(call_timeout_s)
        self.failure_reward = float(failure_reward)
        self.reward_range = (self.failure_reward, 1.0)
        self.scorers = make_scorers(scorers)
        if any(s.group for s in self.scorers):
            raise EnvError("mcp: a judge with mode: group is not supported here; use pointwise")
        mcp_client.import_sdk()
        self.pool = mcp_client.pool(spec, self.isolation, reset_tool)
        listing = {t["name"]: t for t in self.pool.tools()}
        if self.isolation == "reset" and reset_tool not in listing:
            raise EnvError(
                f"mcp: isolation reset calls the tool {reset_tool!r} as each episode "
                f"starts, and server {spec!r} has none (its tools: "
                f"{', '.join(listing)}); set reset_tool, or isolation shared or "
                "fresh"
            )
        self.spec = {
            "server": spec,
            "tasks": str(tasks),
            "eval_path": eval_path,
            "eval_fraction": float(eval_fraction),
            "split_seed": check_int("split_seed", split_seed),
            "system_prompt": system_prompt,
            "scorers": scorers,
            "max_turns": self.max_turns,
            "hidden": [reset_tool] if self.isolation == "reset" else [],
            "allow": tools,
        }
        # the checked tasks of both splits, and the tools the model sees (OpenAI format)
        self.train, self.held_out, self.tools = checked_tasks(self.spec, listing, self.scorers)
        self.answer_tool = answer_tool
        if answer_tool is not None:  # every turn a call, forced by the grammar
            if not isinstance(answer_tool, str) or not answer_tool or answer_tool in listing:
                raise EnvError(
                    f"mcp: answer_tool={answer_tool!r} is invalid: expected a tool "
                    f"name the server does not have (its tools: "
                    f"{', '.join(listing)})"
                )
            self.tools = [*self.tools, _answer_tool(answer_tool)]
        graded = any(
            "expected_calls" in t.data or "score_tool" in t.data for t in self.train + self.held_out
        )
        graded = (
            graded
            or len(self.scorers) > 1
            or any(s.name not in ALL_OR_NOTHING for s in self.scorers)
        )
        # a score tool or a scorer of the user's may give only 0 or 1 (envs check)
        self.uncertain_outcomes = ("partial",)
        failures = (*FAILURES, "no_tool_call") if answer_tool else FAILURES
        self.outcomes = (
            "correct",
            *(("partial",) if graded else ()),
            "wrong",
            "turn_limit",
            *failures,
        )
        self._episode: _Episode | None = None

    # ------------------------------------------------------------------ protocol

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list[Task]:
        """Eval: every held-out row, or a seeded sample of `n`. Train: `n` rows, every row
        used before any is repeated."""
        check_choice("mcp: split", split, ("train", "eval"))
        pool = list(self.train if split == "train" else self.held_out)
        if split == "eval" and n is not None and n >= len(pool):
            n = None
        return sample_items(pool, n, seed)

    def reset(self, task: Task) -> Observation:
        self._end_episode()
        conn = self.pool.checkout(timeout=self.call_timeout_s)
        release = weakref.finalize(self, self.pool.checkin, conn)
        release.atexit = False  # mcp_client closes everything at exit
        self._episode = _Episode(task, conn, release)
        messages = [Message(m["role"], m["content"]) for m in task.data["messages"]]
        choice = "required" if self.answer_tool else "auto"
        return Observation(messages, tools=self.tools, tool_choice=choice)

    def step(self, message: Message) -> StepResult:
        ep = in_progress("mcp", self._episode)
        ep.turns += 1
        failure = message.parse_failure
        if failure == "no_tool_call" and not self.answer_tool:  # no call: the final answer
            failure = None
        if failure is not None:
            self._end_episode()
            return unscored(message, failure, self.failure_reward)
        if not message.tool_calls:
            return self._finish(ep, message.content, [])
        replies = []
        for call in message.tool_calls:  # the calls before an answer call run, then it ends
            if call.name == self.answer_tool:
                return self._finish(ep, as_text(call.arguments.get("answer", "")), replies)
            replies.append(self._call(ep, call))
        if ep.turns >= self.max_turns:
            return self._finish(ep, "", replies, outcome="turn_limit")
        return StepResult(replies, done=False, reward=0.0, info=self._info(ep))

    def demonstrations(self, task: Task) -> list[Message]:
        """The row's expected calls, one message each (packed so that the answer still
        fits in max_turns), then its answer as text; none for a row with neither."""
        calls = task.data.get("expected_calls", [])
        if not calls and "answer" not in task.data:
            return []
        per = max(1, math.ceil(len(calls) / max(1, self.max_turns - 1)))
        out = [
            Message(
                "assistant",
                tool_calls=[
                    ToolCall(c["name"], dict(c["arguments"]), id=f"call_{i + j}")
                    for j, c in enumerate(calls[i : i + per])
                ],
            )
            for i in range(0, len(calls), per)
        ]
        answer = as_text(task.data.get("answer", ""))
        if self.answer_tool:
            final = ToolCall(self.answer_tool, {"answer": answer})
            return [*out, Message("assistant", tool_calls=[final])]
        return [*out, Message("assistant", answer)]

    # ------------------------------------------------------------------ calls and scores

    def _call(self, ep: _Episode, call: ToolCall) -> Message:
        """Run one call on the episode's server; its result (or error) as a tool message."""
        ep.calls.append({"name": call.name, "arguments": call.arguments})
        try:
            wire = self._run(ep, call.name, call.arguments)
        except (mcp_client.ServerFailure, EnvError):
            raise
        except Exception as err:  # an error the server answered with: the model reads it
            ep.tool_errors += 1
            text = f"error: {mcp_client.describe(err)}"
        else:
            ep.tool_errors += bool(wire.get("isError"))
            text = mcp_client.result_text(wire)
        return Message("tool", text, tool_call_id=call.id, name=call.name)

    def _run(self, ep: _Episode, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """One call on the server as its wire dict; a timeout or a dead server ends the
        episode with an EnvError (the connection is closed, a new one serves the next)."""
        try:
            result = ep.conn.call(lambda s: s.call_tool(name, arguments), self.call_timeout_s)
        except mcp_client.ServerFailure as err:
            self.pool.discard(ep.conn)
            self._end_episode()
            tail = ep.conn.stderr_tail()
            raise EnvError(
                f"MCP server {self.pool.spec!r}, tool {name!r}: {err} (call_timeout_s"
                f"={self.call_timeout_s:g}); the server is replaced for the next "
                "episode" + (f"\n--- its stderr ends:\n{tail}" if tail else "")
            ) from None
        return result.model_dump(by_alias=True, exclude_none=True)

    def _finish(
        self, ep: _Episode, answer: str, replies: list[Message], outcome: str | None = None
    ) -> StepResult:
        data = ep.task.data
        scores: dict[str, float] = {}
        try:
            if "answer" in data:
                shown = [m["content"] for m in data["messages"] if m["role"] != "system"]
                row = {
                    **data.get("info", {}),
                    "task_id": ep.task.id,
                    "prompt_text": "\n\n".join(shown),
                }
                scores["answer"] = answer_score(self.scorers, answer, data["answer"], row)
            if "expected_calls" in data:
                scores["calls"] = calls_credit(ep.calls, data["expected_calls"])
            if "score_tool" in data:
                arguments = {"answer": answer, "info": data.get("info", {})}
                wire = self._run(ep, data["score_tool"], arguments)
                scores["score_tool"] = tool_score(wire, data["score_tool"])
        finally:
            self._end_episode()
        reward = sum(scores.values()) / len(scores)
        if outcome is None:
            outcome = reward_label(reward)
        info = {**self._info(ep), "scores": scores}
        return StepResult(replies, done=True, reward=reward, outcome=outcome, info=info)

    def _info(self, ep: _Episode) -> dict[str, Any]:
        return {"tool_calls": len(ep.calls), "tool_errors": ep.tool_errors}

    def _end_episode(self) -> None:
        if self._episode is not None:
            self._episode.release()  # the connection goes back to the pool (once)
            self._episode = None


def _answer_tool(name: str) -> dict[str, Any]:
    parameters = {
        "type": "object",
        "properties": {"answer": {"type": "string"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": "Give your final answer (ends the conversation).",
            "parameters": parameters,
        },
    }


def calls_credit(made: list[dict[str, Any]], expected: list[dict[str, Any]]) -> float:
    """Order-insensitive credit of the made calls against the expected ones (module
    docstring): pairs of the same name, best per-field credit first, each call used once."""
    pairs = sorted(
        (
            (_call_credit(m, e, {}).value, i, j)
            for i, e in enumerate(expected)
            for j, m in enumerate(made)
            if m["name"] == e["name"]
        ),
        reverse=True,
    )
    used_e, used_m, total = set(), set(), 0.0
    for credit, i, j in pairs:
        if i not in used_e and j not in used_m:
            used_e.add(i), used_m.add(j)
            total += credit
    names = {e["name"] for e in expected}
    extra = sum(1 for j, m in enumerate(made) if j not in used_m and m["name"] in names)
    return total / (len(expected) + extra) if expected else float(not made)


def tool_score(wire: dict[str, Any], tool: str) -> float:
    """The score a score tool returned: a number in [0, 1], else an EnvError."""
    if wire.get("isError"):
        raise EnvError(f"the score tool {tool!r} failed: {mcp_client.result_text(wire)}")
    value: Any = wire.get("structuredContent")
    if isinstance(value, dict) and len(value) == 1:
        value = next(iter(value.values()))
    if value is None:
        try:
            value = float(mcp_client.result_text(wire).strip())
        except ValueError:
            value = mcp_client.result_text(wire)
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise EnvError(f"the score tool {tool!r} returned {value!r}; expected a number in [0, 1]")
    return float(value)


ENVIRONMENTS: dict[str, type] = {"mcp": McpTools}
