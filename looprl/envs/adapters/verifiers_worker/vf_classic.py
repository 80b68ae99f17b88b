"""A verifiers classic environment (verifiers 0.1.x: `vf.Environment`, `SingleTurnEnv`,
`ToolEnv`, `Rubric`) played turn by turn.

What the env's own `rollout` does with a model client, this does one request at a time:
its dataset rows (formatted by the env: system prompt, few-shot, `prompt` column) open the
episode through the env's `init_state` and `setup_state`; each tool call goes through the
env's `env_response` (a ToolEnv's tool functions, with its argument parsing, error
formatting and a StatefulToolEnv's injected arguments); the finished conversation becomes
the rollout state (trajectory, completion, stop condition, cleanup handlers run) and every
function of the rubric is called on it with the arguments it asks for. A reward function
that raises is an error of the episode, not the rubric's silent 0.0. Functions of weight
0 (the monitor rubrics' `num_turns`, `total_tool_calls`) are metrics.

Refused with `Unsupported`: an `EnvGroup`, an env that is not a MultiTurnEnv (its own
`rollout`), a MultiTurnEnv whose own `env_response` answers a whole turn (that cannot be
split into the one-call requests of the protocol), group reward functions (they score a
group of rollouts together), a JudgeRubric (it calls a model endpoint), and text
(completion-format) prompts. `@vf.stop` conditions of the env's own are not run: looprl
ends the episode at a reply without a call or at its `max_turns`.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections import OrderedDict
from typing import Any

import verifiers as vf
from verifiers.clients.client import Client
from verifiers.envs.env_group import EnvGroup
from verifiers.envs.stateful_tool_env import StatefulToolEnv
from verifiers.rubrics.judge_rubric import JudgeRubric
from verifiers.types import TrajectoryStep
from verifiers.utils.message_utils import from_raw_message
from vf_common import Unsupported

MAX_EPISODES = 4096  # episodes whose state is kept (the oldest go first)
# whose env_response a ToolEnv's tool calls go through, one call at a time
TURN_BY_TURN = (vf.ToolEnv.env_response, StatefulToolEnv.env_response)


class _NoModel(Client):
    """The client `init_state` stores in the state: looprl samples the replies itself, so
    anything that asks this client for a model response is refused."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise Unsupported(
            "the environment asked verifiers' client for a model response "
            "(a judge, a simulated user); looprl samples every reply "
            "itself"
        )

    setup_client = to_native_tool = to_native_prompt = get_native_response = _refuse
    raise_from_native_response = from_native_response = close = _refuse


def load_env(target: str, config: dict[str, Any]) -> vf.Environment:
    """The environment `target` names: `module:name` (a `vf.Environment`, or a function
    returning one, called with `config`), else an installed env id or a module whose
    `load_environment(**config)` makes it (verifiers' own `vf.load_environment`)."""
    id_or_module, _, attr = target.partition(":")
    module_name = id_or_module.replace("-", "_").split("/")[-1]  # as vf.load_environment
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise Unsupported(
            f"cannot import module {module_name!r}: {err} (it imports from the folder "
            "looprl runs in, or from verifiers' classic environment)"
        ) from None
    if not attr:
        if not callable(getattr(module, "load_environment", None)):
            raise Unsupported(
                f"{module_name} has no load_environment(); name the "
                f"environment as {module_name}:<name>"
            )
        env = vf.load_environment(id_or_module, **config)
    else:
        found = getattr(module, attr, None)
        if found is None:
            raise Unsupported(f"module {module_name!r} has no attribute {attr!r}")
        env = found if isinstance(found, vf.Environment) else found(**config)
    if not isinstance(env, vf.Environment):
        raise Unsupported(f"{target} gave a {type(env).__name__}, not a vf.Environment")
    return env


def _rubric_functions(rubric: vf.Rubric) -> list[tuple[vf.Rubric, Any, float]]:
    """Every (rubric, function, weight) of `rubric`, a RubricGroup's members in order."""
    if isinstance(rubric, vf.RubricGroup):
        return [f for member in rubric.rubrics for f in _rubric_functions(member)]
    if isinstance(rubric, JudgeRubric):
        raise Unsupported(
            f"{type(rubric).__name__} calls a judge model endpoint; looprl "
            "scores with the rubric's own functions only"
        )
    for func in rubric.funcs:
        if rubric._is_group_func(func):
            raise Unsupported(
                f"reward {func.__name__} is a group reward function (it scores "
                "a group of rollouts together); looprl scores each episode "
                "on its own"
            )
    return list(zip([rubric] * len(rubric.funcs), rubric.funcs, rubric.weights, strict=True))


def check_env(env: vf.Environment) -> None:
    """An `Unsupported` naming what `env` needs that the worker cannot give it."""
    name = type(env).__name__
    if isinstance(env, EnvGroup):
        raise Unsupported(f"{name} is an EnvGroup (several environments); name one of them")
    if not isinstance(env, vf.MultiTurnEnv):
        raise Unsupported(
            f"{name} is not a MultiTurnEnv: it runs its own rollout, which "
            "needs a model client; looprl plays each turn itself"
        )
    if not isinstance(env, vf.SingleTurnEnv) and type(env).env_response not in TURN_BY_TURN:
        raise Unsupported(
            f"{name}.env_response answers a whole turn with messages of its own choosing "
            "(a MultiTurnEnv of its own, not a ToolEnv); looprl's worker runs one tool call "
            "at a time, so it cannot honour it"
        )


def _text(content: Any) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    parts = [p.get("text") if isinstance(p, dict) else getattr(p, "text", None) for p in content]
    if any(p is None for p in parts):
        raise Unsupported("a prompt with images: looprl's models read text only")
    return "".join(parts)


def _message(message: dict[str, Any]) -> Any:
    """A looprl (OpenAI-style) message as verifiers' pydantic message."""
    raw = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        raw["tool_calls"] = [
            vf.ToolCall(
                id=c.get("id") or f"call_{i}",
                name=c["function"]["name"],
                arguments=_arguments(c["function"]["arguments"]),
            )
            for i, c in enumerate(message["tool_calls"])
        ]
    if message["role"] == "tool":
        raw["tool_call_id"] = message.get("tool_call_id") or ""
    return from_raw_message(raw)


def _arguments(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


class _Episode:
    """One episode: its rollout state, and the messages its tool calls have seen."""

    def __init__(self, state: vf.State) -> None:
        self.state = state
        self.messages: list[Any] = list(state["prompt"])


class ClassicTasks:
    """The worker's view of a classic environment: its dataset rows, and episodes on them."""

    api = "classic"

    def __init__(self, target: str, config: dict[str, Any]) -> None:
        self.env = load_env(target, config)
        check_env(self.env)
        self.functions = _rubric_functions(self.env.rubric)
        names = [f.__name__ for _, f, _ in self.functions]
        if len(set(names)) < len(names):
            raise Unsupported(f"the rubric has two functions of one name: {names}")
        train, held = self.env.build_dataset(), self.env.build_eval_dataset()
        if train is None:  # only an eval dataset: split it like a taskset
            train, held = held, None
        self.tasks: list[dict[str, Any]] = train.to_list() + (held.to_list() if held else [])
        self.n_train = len(train)
        if not self.tasks:
            raise Unsupported(f"{target} has an empty dataset")
        self.episodes: OrderedDict[str, _Episode] = OrderedDict()

    # ------------------------------------------------------------------ what it holds

    def _prompt_messages(self, index: int) -> list[Any]:
        prompt = self.tasks[index]["prompt"]
        if isinstance(prompt, str):
            raise Unsupported("a text (completion-format) prompt: looprl plays chats")
        return prompt

    def prompt(self, index: int) -> str:
        return json.dumps([[m["role"], _text(m["content"])] for m in self._prompt_messages(index)])

    def describe(self, index: int) -> dict[str, Any]:
        row = self.tasks[index]
        users = [m for m in self._prompt_messages(index) if m["role"] == "user"]
        answer = row.get("answer")
        return {
            "index": index,
            "name": f"{'dataset' if index < self.n_train else 'eval_dataset'}-"
            f"{row.get('example_id')}",  # which of the env's datasets, and its row
            "prompt": _text(users[-1]["content"]) if users else "",
            **({"answer": str(answer)} if isinstance(answer, str | int | float) else {}),
        }

    def has_tools(self) -> bool:
        return isinstance(self.env, vf.ToolEnv) or bool(self.env.tool_defs)

    def eval_indices(self) -> list[int] | None:
        """The env's own eval dataset, where it has one (and a train dataset besides)."""
        return (
            list(range(self.n_train, len(self.tasks))) if len(self.tasks) > self.n_train else None
        )

    def weights(self) -> dict[str, float]:
        return {f.__name__: float(w) for _, f, w in self.functions if w != 0}

    async def start(self) -> None:
        pass  # a classic env sets itself up in its constructor and setup_state

    # ------------------------------------------------------------------ an episode

    async def reset(self, episode: str, index: int) -> dict[str, Any]:
        """The conversation's opening messages and the tools' OpenAI schemas."""
        state = await self.env.init_state(self.tasks[index], _NoModel(None), "looprl")
        await self.env.setup_state(state)
        self.episodes[episode] = _Episode(state)
        while len(self.episodes) > MAX_EPISODES:
            self.episodes.popitem(last=False)
        messages = [{"role": m.role, "content": _text(m.content)} for m in state["prompt"]]
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                },
            }
            for t in state["tool_defs"]
        ]
        return {"messages": messages, "tools": tools}

    async def call(self, episode: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """One tool call through the env's own env_response, as the env answers it (a
        failing tool's error, formatted by the env, is its result)."""
        ep = self._episode(episode)
        if not self.has_tools():
            raise Unsupported(f"{type(self.env).__name__} has no tools to call")
        asked = vf.AssistantMessage(
            content="",
            tool_calls=[
                vf.ToolCall(
                    id=f"call_{len(ep.messages)}", name=name, arguments=_arguments(arguments)
                )
            ],
        )
        ep.messages.append(asked)
        answers = await self.env.env_response(ep.messages, ep.state)
        ep.messages += answers
        return {"content": "\n".join(_text(m.content) for m in answers), "error": False}

    async def score(
        self, episode: str, messages: list[dict[str, Any]], stop: str
    ) -> dict[str, Any]:
        """Every function of the rubric on the finished conversation: a reward's score and
        weight, a metric's value (weight 0)."""
        ep = self.episodes.pop(episode, None) or self._episode(episode)
        state = ep.state
        conversation = [_message(m) for m in messages]
        start = len(state["prompt"])
        state["trajectory"] = [
            TrajectoryStep(
                prompt=conversation[:i],
                completion=[conversation[i]],
                response=None,
                tokens=None,
                reward=None,
                advantage=None,
                is_truncated=False,
                trajectory_id=state["trajectory_id"],
                extras={},
            )
            for i in range(start, len(conversation))
            if conversation[i].role == "assistant"
        ]
        state["completion"] = conversation[start:]
        state["is_completed"] = True
        state["stop_condition"] = (
            "max_turns_reached"
            if stop == "max_turns" or not isinstance(self.env, vf.ToolEnv)
            else "no_tools_called"
        )
        await self.env.cleanup(state)  # the env's cleanup handlers (render_state first)
        rewards, metrics = {}, {}
        for rubric, func, weight in self.functions:
            value = await _call(func, rubric.score_objects(state))
            if weight:
                rewards[func.__name__] = [value, float(weight)]
            else:
                metrics[func.__name__] = value
        await self.env.rubric.cleanup(state)
        return {"rewards": rewards, "metrics": metrics}

    def _episode(self, episode: str) -> _Episode:
        if episode not in self.episodes:
            raise Unsupported(f"no episode {episode!r} in this worker (was it restarted?)")
        return self.episodes[episode]


async def _call(func: Any, objects: dict[str, Any]) -> float:
    """`func` called with the score objects it names (all of them if it takes **kwargs), as
    the rubric calls it, but its exception propagates: the episode's error, not a 0.0."""
    parameters = inspect.signature(func).parameters.values()
    if not any(p.kind == p.VAR_KEYWORD for p in parameters):
        names = {p.name for p in parameters}
        objects = {k: v for k, v in objects.items() if k in names}
    value = func(**objects)
    if inspect.isawaitable(value):
        value = await value
    return float(value)
