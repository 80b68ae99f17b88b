"""A verifiers v1 taskset (verifiers >= 0.4: `vf.Taskset` of `vf.Task`s) played turn by turn.

What verifiers' own `null` harness does in a program of its own, this does in the worker:
the task's system prompt and prompt open the conversation, its toolsets' `@vf.tool` methods
are listed and called in-process (through an in-memory MCP server, so schemas, argument
checks and results are verifiers' own), and the finished conversation becomes a `vf.Trace`
that the task's `score` fills with every `@vf.reward` and its weight. A tool's `self.state`
is the episode's `trace.state`, as the rollout's state channel makes it in verifiers.

Refused with `Unsupported`: a task that needs a container, a toolset on a remote URL or in
a container runtime, an `Env` (several agents) or a `Harness` of the taskset's own, judge
plugins (they call a model endpoint), and a reward, setup or finalize hook that needs a
runtime (a sandbox).
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
import json
from collections import OrderedDict
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.graph import MessageNode
from verifiers.v1.state import state_cls
from verifiers.v1.trace import AgentInfo, TraceTask
from verifiers.v1.types import content_text
from verifiers.v1.utils.decorators import invoke
from verifiers.v1.utils.generic import concrete_type
from vf_common import Unsupported

MAX_TASKS = 100_000  # an infinite taskset is read this far
MAX_EPISODES = 4096  # episodes whose state is kept (the oldest go first)
# the episode whose tool runs now: whose trace.state a tool's `self.state` reads and writes
_CURRENT: contextvars.ContextVar[_Episode] = contextvars.ContextVar("looprl_episode")


def _exported(module: Any, base: type) -> list[type]:
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    found = [getattr(module, n, None) for n in names]
    return [c for c in found if isinstance(c, type) and issubclass(c, base) and c is not base]


def load_taskset(target: str, config: dict[str, Any]) -> vf.Taskset:
    """The taskset `module[:name]` names: a `vf.Taskset` subclass (the module's only
    exported one when no name is given) built from its config with `config`'s fields, or
    a factory function (`load_taskset` / `load_environment`) called with `config`."""
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise Unsupported(
            f"cannot import module {module_name!r}: {err} (it imports from the "
            "folder looprl runs in, or from verifiers' environment)"
        ) from None
    for base, what in ((vf.Env, "an Env (several agents)"), (vf.Harness, "a Harness")):
        own = [c for c in _exported(module, base) if c.__module__.startswith(module_name)]
        if own and not attr:
            raise Unsupported(
                f"{module_name} ships {what} of its own ({own[0].__name__}); "
                "looprl plays the task as a plain chat with tools"
            )
    if attr:
        found = getattr(module, attr, None)
        if found is None:
            raise Unsupported(f"module {module_name!r} has no attribute {attr!r}")
    else:
        classes = _exported(module, vf.Taskset)
        factories = [
            getattr(module, n)
            for n in ("load_taskset", "load_environment")
            if callable(getattr(module, n, None))
        ]
        if len(classes) > 1:
            raise Unsupported(
                f"{module_name} exports several tasksets "
                f"({', '.join(c.__name__ for c in classes)}); name one as "
                f"{module_name}:<Class>"
            )
        if not classes and not factories:
            raise Unsupported(
                f"{module_name} exports no vf.Taskset subclass and has no "
                "load_taskset() or load_environment()"
            )
        found = classes[0] if classes else factories[0]
    if isinstance(found, type) and issubclass(found, vf.Taskset):
        config_cls = concrete_type(found, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        return found(config_cls.model_validate(config))
    taskset = found(**config)
    if not isinstance(taskset, vf.Taskset):
        raise Unsupported(f"{target} gave a {type(taskset).__name__}, not a vf.Taskset")
    return taskset


def _requires_runtime(fn: Any) -> bool:
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def _overrides(task: vf.Task, hook: str) -> bool:
    return getattr(type(task), hook) is not getattr(vf.Task, hook)


def check_task(task: vf.Task) -> None:
    """An `Unsupported` naming what `task` needs that the worker cannot give it."""
    name = type(task).__name__
    if task.NEEDS_CONTAINER:
        raise Unsupported(
            f"task {name} needs a container (NEEDS_CONTAINER); looprl runs "
            "tasks in-process, with no sandbox"
        )
    if task.config.judges:
        raise Unsupported(
            f"task {name} plugs judges, which call a model endpoint; looprl "
            "scores with the task's own rewards only"
        )
    for fn in task.hooks("reward") + task.hooks("metric"):
        if _requires_runtime(fn):
            raise Unsupported(
                f"reward {fn.__name__} of task {name} needs a runtime (a sandbox) to score"
            )
    for hook in ("setup", "finalize"):
        if _overrides(task, hook) and _requires_runtime(getattr(task, hook)):
            raise Unsupported(f"task {name}'s {hook} hook needs a runtime (a sandbox)")


def _check_toolset(toolset: Any) -> None:
    config = toolset.config
    where = getattr(config, "url", None)
    if where:
        raise Unsupported(
            f"toolset {type(toolset).__name__} is served at {where}; looprl "
            "runs tools in-process only"
        )
    runtime = getattr(getattr(config, "runtime", None), "type", "subprocess")
    if runtime != "subprocess":
        raise Unsupported(
            f"toolset {type(toolset).__name__} runs in a {runtime} runtime (a "
            "container); looprl runs tools in-process only"
        )


def _text(content: Any) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    if any(not isinstance(p, vf.TextContentPart) for p in content):
        raise Unsupported("a prompt with images: looprl's models read text only")
    return content_text(content)


class _Episode:
    """One episode in the worker: its task, its trace (whose `state` the tools share),
    its tool servers and how many prompt messages it began with."""

    def __init__(self, task: vf.Task) -> None:
        self.task = task
        self.trace = vf.Trace(
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            state=state_cls(type(task))(),
            agent=AgentInfo(config=vf.AgentConfig()),
        )
        self.servers: dict[str, tuple[Any, str]] = {}  # tool name -> (MCP server, its name)
        self.prompt_len = 0


class V1Tasks:
    """The worker's view of a v1 taskset: its tasks, and episodes played on them."""

    api = "v1"

    def __init__(self, target: str, config: dict[str, Any]) -> None:
        self.taskset = load_taskset(target, config)
        view = self.taskset if self.taskset.bounded else self.taskset.take(MAX_TASKS)
        self.tasks: list[vf.Task] = list(view)
        if not self.tasks:
            raise Unsupported(f"{target} yielded no tasks")
        check_task(self.tasks[0])
        self.shared = type(self.taskset).toolsets(self.taskset.config)
        self.episodes: OrderedDict[str, _Episode] = OrderedDict()

    # ------------------------------------------------------------------ what it holds

    def prompt(self, index: int) -> str:
        data = self.tasks[index].data
        return f"{data.system_prompt or ''}\n\n{_text(data.prompt)}"

    def describe(self, index: int) -> dict[str, Any]:
        data = self.tasks[index].data
        answer = getattr(data, "answer", None)  # a field many tasksets' data carries
        return {
            "index": index,
            "name": data.id or data.name,
            "prompt": _text(data.prompt),
            **({"answer": str(answer)} if isinstance(answer, str | int | float) else {}),
        }

    def has_tools(self) -> bool:
        task = self.tasks[0]
        return bool(self.shared or task.toolsets(task.config))

    def eval_indices(self) -> None:
        return None  # v1 tasksets give no eval split of their own

    def weights(self) -> dict[str, float]:
        return {
            fn.__name__: float(getattr(fn, "_vf_weight", 1.0))
            for fn in self.tasks[0].hooks("reward")
        }

    async def start(self) -> None:
        for toolset in self.shared:
            _check_toolset(toolset)
            await toolset.setup()

    # ------------------------------------------------------------------ an episode

    async def reset(self, episode: str, index: int) -> dict[str, Any]:
        """The conversation's opening messages and the tools' OpenAI schemas."""
        task = self.tasks[index]
        check_task(task)
        ep = _Episode(task)
        self.episodes[episode] = ep
        while len(self.episodes) > MAX_EPISODES:
            self.episodes.popitem(last=False)
        if _overrides(task, "setup"):
            await invoke(task.setup, {"trace": ep.trace, "runtime": None})
        tools = []
        for toolset in [*task.toolsets(task.config), *self.shared]:
            tools += await self._serve(ep, toolset, shared=toolset in self.shared)
        data = task.data
        messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        else:
            messages += [{"role": m.role, "content": _text(m.content)} for m in data.prompt or []]
        ep.prompt_len = len(messages)
        return {"messages": messages, "tools": tools}

    async def _serve(self, ep: _Episode, toolset: Any, shared: bool) -> list[dict[str, Any]]:
        """List `toolset`'s tools for `ep` (its state is the episode's trace.state)."""
        from mcp.server.mcpserver import MCPServer

        _check_toolset(toolset)
        if not shared:
            await toolset.setup()
            await toolset.setup_task(ep.task)
        _share_state(toolset)
        server = MCPServer(toolset.server_name or type(toolset).__name__)
        toolset.register(server)
        schemas = []
        for tool in await server.list_tools():
            name = f"{toolset.server_name}_{tool.name}" if toolset.server_name else tool.name
            ep.servers[name] = (server, tool.name)
            schemas.append(
                {
                    "type": "function",
                    "function": {
                        "name": name,
                        "description": tool.description or "",
                        "parameters": tool.input_schema,
                    },
                }
            )
        return schemas

    async def call(self, episode: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """A tool's result as the model sees it; a failing tool's error is its result, as
        an MCP server answers it."""
        ep = self._episode(episode)
        if name not in ep.servers:
            return {"content": f"Error: unknown tool {name!r}", "error": True}
        server, raw = ep.servers[name]
        token = _CURRENT.set(ep)
        try:
            result = await server.call_tool(raw, arguments)
        except Exception as err:
            return {"content": f"Error: {err}", "error": True}
        finally:
            _CURRENT.reset(token)
        blocks = getattr(result, "content", None) or []
        text = "\n".join(getattr(b, "text", None) or str(b) for b in blocks)
        return {"content": text, "error": bool(getattr(result, "is_error", False))}

    async def score(
        self, episode: str, messages: list[dict[str, Any]], stop: str
    ) -> dict[str, Any]:
        """Every reward's score and weight (and every metric) on the finished conversation."""
        ep = self.episodes.pop(episode, None) or self._episode(episode)
        trace = ep.trace
        for i, message in enumerate(messages):
            node = MessageNode(
                parent=i - 1 if i else None,
                message=_message(message),
                sampled=i >= ep.prompt_len and message["role"] == "assistant",
            )
            trace.nodes.append(node)
        trace.stop(stop)
        if _overrides(ep.task, "finalize"):
            await invoke(ep.task.finalize, {"trace": trace, "runtime": None})
        await ep.task.score(trace, None)
        trace.is_completed, trace.ok = True, True
        rewards = {
            name: None if r is None else [r.score, r.weight] for name, r in trace.rewards.items()
        }
        return {"rewards": rewards, "metrics": dict(trace.metrics)}

    def _episode(self, episode: str) -> _Episode:
        if episode not in self.episodes:
            raise Unsupported(f"no episode {episode!r} in this worker (was it restarted?)")
        return self.episodes[episode]


def _share_state(toolset: Any) -> None:
    """Make `toolset`'s state the current episode's trace.state: what verifiers' state
    channel does over HTTP (GET /state before a call, PUT /state after it)."""
    adapter = toolset._state_adapter

    async def pull() -> Any:
        return adapter.validate_json(_CURRENT.get().trace.state.model_dump_json())

    async def push(before: bytes) -> None:
        after = adapter.dump_json(toolset.state)
        if after != before:
            trace = _CURRENT.get().trace
            trace.state = type(trace.state).model_validate_json(after)

    toolset._pull_state, toolset._push_state = pull, push


def _message(message: dict[str, Any]) -> Any:
    role, content = message["role"], message.get("content") or ""
    if role == "system":
        return vf.SystemMessage(content=content)
    if role == "user":
        return vf.UserMessage(content=content)
    if role == "tool":
        return vf.ToolMessage(
            tool_call_id=message.get("tool_call_id") or "",
            content=content,
            name=message.get("name"),
        )
    calls = [
        vf.ToolCall(
            id=c.get("id") or f"call_{i}",
            name=c["function"]["name"],
            arguments=_arguments(c["function"]["arguments"]),
        )
        for i, c in enumerate(message.get("tool_calls") or [])
    ]
    return vf.AssistantMessage(content=content, tool_calls=calls or None)


def _arguments(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)
