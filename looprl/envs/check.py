"""The environment test kit behind `looprl envs check NAME`.

It plays an environment with three scripted agents, no model involved:

- `random`: each turn either a random tool call drawn from the tool schemas or random
  text run through the real tool-call parser (so every parse-failure class occurs);
- `expert`: the environment's `demonstrations(task)`, when it has them;
- `perturbed`: the expert making one mistake per episode, every one in turn: each
  turn skipped, nudged (one argument off by one, one character off) or replaced by a
  random call. It reaches the in-between outcomes that a random or an expert agent
  never does.

and checks what every environment must guarantee: the same seed gives the same tasks,
the train and eval splits share no task, rewards stay inside `reward_range`, outcomes
are declared, every declared outcome is reachable (an env's `uncertain_outcomes`, such as
`partial` from a scorer of the user's, are reported when unreached, not failed), nothing
raises, and a step is fast.
"""

from __future__ import annotations

import json
import math
import random
import string
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from looprl.chat.parsers import parse_tool_calls, validate_arguments
from looprl.envs import demonstrations, gives_turn_rewards, make_env
from looprl.envs.schema_values import random_value
from looprl.types import Message, Task, ToolCall

AGENTS = ("random", "expert", "perturbed")
_WORDS = ["hello", "order", "refund", "the", "square", "5", "json", "Dear", "thanks", "—", "é"]
__all__ = ["check_env", "random_value"]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class AgentStats:
    episodes: int = 0
    rewards: list[float] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    step_seconds: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    turn_rewards: list[Any] = field(default_factory=list)  # StepResult.turn_reward, each step


@dataclass
class CheckReport:
    env: str
    checks: list[Check]
    agents: dict[str, AgentStats]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


# ------------------------------------------------------------------ random actions


def _as_parsed(message: Message, tools: list[dict[str, Any]]) -> Message:
    """`message` as the chat layer would pass it on: a call whose arguments break the
    tool's schema becomes a `bad_arguments` failure."""
    for call in message.tool_calls:
        problem = validate_arguments(call, tools)
        if problem is not None:
            return Message("assistant", parse_failure="bad_arguments", parse_detail=problem)
    return message


def _random_call(tools: list[dict[str, Any]], rng: random.Random) -> Message:
    """A schema-shaped call, rejected as `bad_arguments` the way the chat layer would."""
    fn = rng.choice(tools)["function"]
    call = ToolCall(fn["name"], random_value(fn.get("parameters", {}), rng), id="call_0")
    return _as_parsed(Message("assistant", tool_calls=[call]), tools)


def _random_text(
    tools: list[dict[str, Any]], rng: random.Random, require_call: bool, kind: int
) -> Message:
    """Text of variant `kind` parsed by the real parser (hermes syntax): empty, prose,
    broken JSON, an unknown tool, bad arguments or bare JSON."""
    name = rng.choice(tools)["function"]["name"] if tools else "tool"
    texts = [
        "",
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 40))),
        '<tool_call>\n{"name": "' + name + '", "arguments": {',
        '<tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "' + name + '", "arguments": {"zz": []}}\n</tool_call>',
        '{"' + rng.choice(string.ascii_lowercase) + '": 1}',
    ]
    text = texts[kind % len(texts)]
    result = parse_tool_calls(text, tools, "hermes", require_call=require_call)
    return Message(
        "assistant",
        content=result.content,
        tool_calls=result.calls,
        parse_failure=result.failure,
        parse_detail=result.detail,
    )


def random_action(
    obs_tools: list[dict[str, Any]], tool_choice: str, rng: random.Random, episode: int, turn: int
) -> Message:
    """Schema-shaped calls, except the first turn of every third episode: text, whose
    variants take turns so that a few dozen episodes cover every parse failure. (Text
    ends most episodes, so later turns stay calls and long episodes happen too.)"""
    require_call = bool(obs_tools) and tool_choice != "none"
    if require_call and (turn > 0 or episode % 3 != 0):
        return _random_call(obs_tools, rng)
    return _random_text(obs_tools if require_call else [], rng, require_call, episode // 3)


def _nudge(value: Any, rng: random.Random) -> Any:
    """A value close to `value`: ±1 for numbers, one character off for text."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + rng.choice((-1, 1))
    if isinstance(value, str) and len(value) > 1:
        i = rng.randrange(len(value))
        return value[:i] + value[i + 1 :]
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list) and value:
        return value[:-1]
    if isinstance(value, dict) and value:
        key = rng.choice(sorted(value))
        return {**value, key: _nudge(value[key], rng)}
    return value


def near_miss(message: Message, rng: random.Random, tools: list[dict[str, Any]]) -> Message:
    """The expert's message with one argument (or its text) nudged."""
    if not message.tool_calls:
        return Message("assistant", content=_nudge(message.content, rng))
    calls = [ToolCall(c.name, dict(c.arguments), c.id) for c in message.tool_calls]
    call = rng.choice(calls)
    if call.arguments:
        key = rng.choice(sorted(call.arguments))
        call.arguments[key] = _nudge(call.arguments[key], rng)
    return _as_parsed(Message("assistant", content=message.content, tool_calls=calls), tools)


# ------------------------------------------------------------------ playing


def play(
    env: Any,
    task: Task,
    agent: str,
    rng: random.Random,
    stats: AgentStats,
    mistake: tuple[int, int] | None = None,
) -> tuple[float, str] | None:
    """One episode with `agent`; None if there is nothing to play (no demonstrations).
    The perturbed agent makes `mistake` = (turn, kind), see `_next_message`."""
    demos = list(demonstrations(env, task) or []) if agent != "random" else []
    if agent != "random" and not demos:
        return None
    obs = env.reset(task)
    reward, outcome = 0.0, ""
    for turn in range(max(1, int(env.max_turns))):
        message = _next_message(agent, demos, obs, rng, stats.episodes, turn, mistake)
        started = time.perf_counter()
        result = env.step(message)
        stats.step_seconds.append(time.perf_counter() - started)
        stats.turn_rewards.append(result.turn_reward)
        reward, outcome = float(result.reward), result.outcome or ""
        if result.done:
            break
    else:
        outcome = "truncated"
    stats.episodes += 1
    stats.rewards.append(reward)
    stats.outcomes[outcome] = stats.outcomes.get(outcome, 0) + 1
    return reward, outcome


def _turn_reward_check(env: Any, given: list[Any]) -> Check:
    """An env that declares `gives_turn_rewards` grades every step with a finite number;
    one that does not never grades (training would silently ignore it)."""
    if not gives_turn_rewards(env):
        graded = sum(t is not None for t in given)
        detail = (
            f"{graded} of {len(given)} steps set turn_reward, but the env does not declare "
            "gives_turn_rewards = True"
            if graded
            else "none given, none declared"
        )
        return Check("turn rewards", not graded, detail)
    bad = [t for t in given if not isinstance(t, int | float) or not math.isfinite(t)]
    detail = f"{len(given) - len(bad)} of {len(given)} steps graded with a finite number"
    return Check("turn rewards", not bad, detail + (f"; e.g. {bad[0]!r}" if bad else ""))


def _next_message(
    agent: str,
    demos: list[Message],
    obs: Any,
    rng: random.Random,
    episode: int,
    turn: int,
    mistake: tuple[int, int] | None,
) -> Message:
    """The expert's next message (popped from `demos`), or, on the turn of `mistake`, its
    kind: 0 skips the expert's message (a lone text reply, which cannot be skipped, gets a
    stray character instead), 1 nudges it, 2 plays a random call instead."""
    wants_call = bool(obs.tools) and obs.tool_choice != "none"
    if demos and (mistake is None or turn != mistake[0]):
        return demos.pop(0)
    if demos:
        if mistake[1] == 0 and len(demos) > 1:
            demos.pop(0)  # a forgotten step
            return demos.pop(0)
        if mistake[1] == 0 and not demos[0].tool_calls and demos[0].content:
            text = demos.pop(0).content
            i = rng.randrange(len(text) + 1)
            return Message("assistant", text[:i] + rng.choice(string.ascii_letters) + text[i:])
        if mistake[1] == 1:
            return near_miss(demos.pop(0), rng, obs.tools)
        demos.pop(0)
    if agent == "perturbed" and wants_call:
        return _random_call(obs.tools, rng)  # a plausible mistake, not gibberish
    return random_action(obs.tools, obs.tool_choice, rng, episode, turn)


def _task_key(task: Task) -> tuple[str, int]:
    return json.dumps(task.data, sort_keys=True, default=str), task.seed


def _same_tasks(a: list[Task], b: list[Task]) -> bool:
    return [(t.id, *_task_key(t)) for t in a] == [(t.id, *_task_key(t)) for t in b]


def _split(env: Any, split: str, n: int, seed: int) -> list[Task]:
    """All tasks of a bounded split, or `n` of an unbounded one."""
    try:
        return env.tasks(split, n=None, seed=seed)
    except Exception:
        return env.tasks(split, n=n, seed=seed)


# ------------------------------------------------------------------ the checks


def check_env(
    name: str,
    args: dict[str, Any] | None = None,
    n: int = 64,
    seed: int = 0,
    max_step_ms: float = 1000.0,
) -> CheckReport:
    """Run every check on `name` with `n` tasks per agent (at least 1)."""
    checks: list[Check] = []
    env = make_env(name, args)
    declared = set(env.outcomes)
    low, high = env.reward_range

    # Same seed → same tasks (also across fresh instances); task data is JSON.
    train = env.tasks("train", n=n, seed=seed)
    evals = env.tasks("eval", n=n, seed=seed)
    again = make_env(name, args)
    same = _same_tasks(train, again.tasks("train", n=n, seed=seed)) and _same_tasks(
        evals, again.tasks("eval", n=n, seed=seed)
    )
    checks.append(Check("deterministic tasks", same, f"{len(train)} train + {len(evals)} eval"))
    try:
        json.dumps([t.data for t in train + evals])
        checks.append(Check("task data is JSON", True, "json.dumps works"))
    except (TypeError, ValueError) as err:
        checks.append(Check("task data is JSON", False, str(err)))

    # Disjoint splits: no shared (data, seed) and no shared id.
    all_eval = _split(env, "eval", max(n, 256), seed)
    all_train = _split(env, "train", max(n, 1024), seed)
    shared_keys = {_task_key(t) for t in all_eval} & {_task_key(t) for t in all_train}
    shared_ids = {t.id for t in all_eval} & {t.id for t in all_train}
    checks.append(
        Check(
            "train/eval disjoint",
            not shared_keys and not shared_ids,
            f"{len(all_train)} train vs {len(all_eval)} eval tasks; "
            f"{len(shared_keys)} shared tasks, {len(shared_ids)} shared ids",
        )
    )

    if callable(getattr(env, "run_agent", None)):  # an agent env (looprl.agents)
        detail = "run_agent needs a model: play it with `looprl eval` or `looprl run`"
        return CheckReport(name, [*checks, Check("agent env: tasks only", True, detail)], {})

    checks.append(_schema_check(make_env(name, args), train[:4] + evals[:4]))
    agents = {agent: AgentStats() for agent in AGENTS}
    rng = random.Random(seed)
    for agent, stats in agents.items():
        for task in train[: max(1, n)]:
            # The perturbed agent tries every single mistake: each turn, each kind.
            turns = len(demonstrations(env, task) or []) if agent == "perturbed" else 0
            mistakes = [(t, kind) for t in range(turns) for kind in range(3)] or [None]
            for mistake in mistakes:
                try:
                    play(make_env(name, args), task, agent, rng, stats, mistake)
                except Exception as err:
                    stats.errors.append(f"task {task.id}: " + _last_lines(err))

    # Replaying the expert gives the same result.
    if agents["expert"].episodes:
        checks.append(_replay_check(name, args, train[:4]))

    errors = [f"{a}: {e}" for a, s in agents.items() for e in s.errors]
    checks.append(Check("no exceptions", not errors, errors[0] if errors else "none raised"))
    rewards = [r for s in agents.values() for r in s.rewards]
    outside = [r for r in rewards if not low <= r <= high]
    checks.append(
        Check(
            "rewards in range",
            not outside,
            f"{len(outside)} of {len(rewards)} outside [{low}, {high}]"
            + (f", e.g. {outside[0]}" if outside else ""),
        )
    )
    checks.append(_turn_reward_check(env, [t for s in agents.values() for t in s.turn_rewards]))
    seen = {o for s in agents.values() for o in s.outcomes}
    undeclared = sorted(seen - declared)
    checks.append(
        Check("outcomes declared", not undeclared, ", ".join(undeclared) or "all declared")
    )
    # an outcome that only some of a user's scorers give (`partial` from a reward function
    # that may return only 0 or 1) is reported, not failed, when no agent reaches it
    maybe = set(getattr(env, "uncertain_outcomes", ()) or ())
    unreached = sorted(declared - seen - maybe)
    unsure = sorted((declared - seen) & maybe)
    detail = "missing: " + ", ".join(unreached) if unreached else (
        f"all {len(declared) - len(unsure)} reached" + (
            f"; {', '.join(unsure)} not reached (it depends on your scorer's values)"
            if unsure else ""))  # fmt: skip
    checks.append(Check("outcomes reachable", not unreached, detail))
    steps = [t for s in agents.values() for t in s.step_seconds]
    mean_ms = 1000 * sum(steps) / max(1, len(steps))
    checks.append(
        Check("step time", mean_ms <= max_step_ms, f"{mean_ms:.2f} ms mean over {len(steps)}")
    )
    if not agents["expert"].episodes:
        checks.append(Check("expert agent", True, "skipped: no demonstrations(task)"))
    return CheckReport(name, checks, agents)


def _schema_check(env: Any, tasks: list[Task]) -> Check:
    """Every tool's parameters (and a JSON reply's schema) is a valid JSON schema."""
    import jsonschema

    seen = 0
    for task in tasks:
        try:
            obs = env.reset(task)
        except Exception as err:
            return Check("tool schemas valid", False, f"reset({task.id}): {_last_lines(err)}")
        schemas = [(t.get("function", t).get("name"), t.get("function", t).get("parameters"))
                   for t in obs.tools]  # fmt: skip
        fmt = getattr(obs, "response_format", None) or {}
        schemas.append(("response_format", (fmt.get("json_schema") or {}).get("schema")))
        for owner, schema in schemas:
            if schema is None:
                continue
            seen += 1
            try:
                jsonschema.validators.validator_for(schema).check_schema(schema)
            except jsonschema.SchemaError as err:
                return Check("tool schemas valid", False, f"{owner}: {err.message}")
    return Check("tool schemas valid", True, f"{seen} schemas of {len(tasks)} tasks")


def _replay_check(name: str, args: dict[str, Any] | None, tasks: list[Task]) -> Check:
    def replay() -> list[tuple[float, str] | None]:
        return [play(make_env(name, args), t, "expert", random.Random(0), AgentStats())
                for t in tasks]  # fmt: skip

    try:
        same = replay() == replay()
    except Exception as err:
        return Check("deterministic episodes", False, _last_lines(err))
    return Check("deterministic episodes", same, f"expert replayed on {len(tasks)} tasks")


def _last_lines(err: BaseException) -> str:
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    return " | ".join(text.strip().splitlines()[-3:])
