"""Bring your own agent: train an agent written with the official OpenAI client, unchanged.

An agent environment is a class with `name`, `description`, `outcomes`, `reward_range`,
`max_turns` (model calls per episode), `tasks(split, n, seed)` and

    async def run_agent(self, client, task) -> AgentResult(reward, outcome, info)

where `client` is an `openai.AsyncOpenAI` answered in-process by the policy being trained
(see looprl/agents/proxy.py for what a call may ask and how calls become one token trajectory).
A plain `def run_agent(self, client, task)` gets an `openai.OpenAI` instead and runs in a
thread of its own (looprl/agents/sync_proxy.py); its calls are answered on the event loop
like the async ones, so batching, stitching and limits are the same.
`run_agents` plays a rollout of such episodes with the same signature as
`rollout.run_episodes`, so training, evaluation, reports and resume work unchanged.

Batching. All episodes of a rollout run concurrently in one asyncio event loop. A
scheduler collects the pending model calls and sends them to `engine.generate` as one
batch as soon as every live agent is waiting for the model or finished (batching.py); an
agent busy elsewhere (slow I/O) holds a batch back at most `BATCH_WAIT_S`. A sync agent's
thread that waits for its reply counts as waiting; every sync agent has its own thread (no
pool), so all of them can wait at once. Generation runs on the loop's thread (the tokenizer is
shared with rendering), so async agents pause meanwhile.
Batch k samples with seed `turn_seed(params.seed, k)`, as run_episodes seeds turn k: agents
that call in lock-step get the very tokens the built-in rollout would give them.

Errors. An agent that raises (an openai error it does not handle included), returns
something other than a valid `AgentResult` (reward outside `reward_range`, undeclared
outcome) or runs longer than `EPISODE_TIMEOUT_S` ends its episode as `env_error` with the
explanation in `episode.error`: counted, shown in the samples, left out of the loss.
After a refused call for a limit (`max_turns`, `rollout.max_episode_tokens`) the episode
is `truncated`, whatever the agent does next; its reward is the agent's if it still
returns a valid result, else 0 (clipped into `reward_range`). A reply cut by
`rollout.max_new_tokens` (a forced call then comes back with `tool_calls=None`) that makes
the agent raise is `truncated` too, with the env's lowest reward: the policy's fault, not
the environment's.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from looprl.agents.batching import CallBatcher
from looprl.chat import ChatRenderer
from looprl.engine import RolloutEngine, SamplingParams
from looprl.types import ENV_ERROR, TRUNCATED, Episode, Task, Turn

EPISODE_TIMEOUT_S = 600.0  # an agent still running after this is an env_error


@dataclass
class AgentResult:
    """What `run_agent` returns: the episode's reward, its outcome label (one of the
    env's `outcomes`) and free-form JSON-able details for the transcripts."""

    reward: float
    outcome: str
    info: dict[str, Any] = field(default_factory=dict)


def is_agent_env(env: Any) -> bool:
    """Agent environments are recognised by their `run_agent` method."""
    return callable(getattr(env, "run_agent", None))


# ============================================================================ episodes


def run_agents(
    tasks: list[Task],
    make_env: Callable[[], Any],
    engine: RolloutEngine,
    renderer: ChatRenderer,
    params: SamplingParams,
    max_turns: int,
    max_episode_tokens: int,
    on_progress: Callable[[int], None] | None = None,
    first_index: int = 0,
) -> list[Episode]:
    """Play one agent episode per entry of `tasks` (repeat a task for a group), all
    concurrently, and return them in the same order (see the module doc). `on_progress(n)`
    hears how many episodes have ended, as they end, like `rollout.run_episodes`, and
    episode i samples from random stream `first_index + i`, as there."""
    play = _play(
        tasks,
        make_env,
        engine,
        renderer,
        params,
        max_turns,
        max_episode_tokens,
        on_progress,
        first_index,
    )
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(play)
    with ThreadPoolExecutor(1) as pool:  # called from inside an event loop (a notebook)
        return pool.submit(asyncio.run, play).result()


async def _play(
    tasks: list[Task],
    make_env: Callable[[], Any],
    engine: RolloutEngine,
    renderer: ChatRenderer,
    params: SamplingParams,
    max_turns: int,
    max_episode_tokens: int,
    on_progress: Callable[[int], None] | None,
    first_index: int,
) -> list[Episode]:
    from looprl.agents.proxy import AgentSession

    batcher = CallBatcher(engine, params, len(tasks), on_progress, first_index)
    sessions = [
        AgentSession(
            renderer,
            batcher.caller(i),
            max_turns,
            max_episode_tokens,
            params.max_new_tokens,
            engine=engine,
        )
        for i in range(len(tasks))
    ]
    agents = [
        asyncio.create_task(_episode(task, make_env, session, batcher))
        for task, session in zip(tasks, sessions)
    ]
    # an agent's next call usually extends its last one token for token (the session
    # stitches it so): inside an engine session that call prefills only its new tokens
    session = getattr(engine, "session", None)
    try:
        with session() if session is not None else contextlib.nullcontext():
            await batcher.run()  # an engine failure propagates: it is no agent's fault
    finally:
        for agent in agents:
            agent.cancel()
        await asyncio.gather(*agents, return_exceptions=True)
    return [agent.result() for agent in agents]


async def _episode(
    task: Task, make_env: Callable[[], Any], session: Any, batcher: CallBatcher
) -> Episode:
    """Run one agent and turn its session into an Episode."""
    episode = Episode(
        task=task,
        messages=[],
        token_ids=[],
        loss_mask=[],
        logprobs=[],
        temperature=batcher.params.temperature,  # every batch samples with these params
    )
    result: AgentResult | None = None
    reward_range = (0.0, 0.0)
    try:
        env = make_env()
        reward_range = env.reward_range
        result = _check_result(await _with_timeout(_run_agent(env, task, session)), env)
    except Exception as err:
        if session.truncated is None:
            episode.outcome = ENV_ERROR
            episode.error = _traceback(err)
    finally:
        session.closed = True
        batcher.finished()
    _fill(episode, session, result, reward_range)
    return episode


async def _run_agent(env: Any, task: Task, session: Any) -> Any:
    """An `async def run_agent` on the loop with an AsyncOpenAI; a plain one in a thread
    of its own with an OpenAI."""
    from looprl.agents.proxy import openai_client
    from looprl.agents.sync_proxy import sync_openai_client

    if inspect.iscoroutinefunction(env.run_agent):
        client = openai_client(session)
        try:
            return await env.run_agent(client, task)
        finally:
            await client.close()
    loop = asyncio.get_running_loop()

    def play() -> Any:
        with sync_openai_client(session, loop) as client:
            result = env.run_agent(client, task)
        if inspect.isawaitable(result):
            with contextlib.suppress(AttributeError):
                result.close()  # a coroutine nobody will await
            raise AgentResultError(
                "run_agent returned an awaitable; declare it `async def run_agent` to get an "
                "openai.AsyncOpenAI, or `def run_agent` for an openai.OpenAI"
            )
        return result

    return await _in_thread(play)


async def _in_thread(work: Callable[[], Any]) -> Any:
    """Await `work()` run in a daemon thread. A thread, not a pool: every sync agent must
    be able to wait for the model at once, and one that outlives its timeout is left
    behind (a thread cannot be stopped; its later calls are refused)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # timed out
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run() -> None:
        result, error = None, None
        try:
            result = work()
        except Exception as err:
            error = err
        except BaseException as err:  # SystemExit and the like: not for the event loop
            error = RuntimeError(f"the agent thread ended with {type(err).__name__}: {err}")
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="looprl-agent", daemon=True).start()
    return await future


async def _with_timeout(agent: Any) -> Any:
    running = asyncio.ensure_future(agent)
    done, _ = await asyncio.wait({running}, timeout=EPISODE_TIMEOUT_S)
    if not done:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        raise AgentResultError(
            f"the agent was still running after {EPISODE_TIMEOUT_S:.0f} s "
            "(looprl.agents.runner.EPISODE_TIMEOUT_S)"
        )
    return running.result()


class AgentResultError(Exception):
    """`run_agent` returned no valid AgentResult for its env (or never returned)."""


def _check_result(result: Any, env: Any) -> AgentResult:
    if not isinstance(result, AgentResult):
        raise AgentResultError(
            f"run_agent returned {type(result).__name__} {result!r:.80}; it must return "
            "looprl.agents.AgentResult(reward, outcome, info)"
        )
    reward, outcome = result.reward, result.outcome
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise AgentResultError(f"AgentResult.reward={reward!r} is not a finite number")
    low, high = env.reward_range
    if not low <= reward <= high:
        raise AgentResultError(
            f"AgentResult.reward={reward} is outside the env's reward_range [{low}, {high}]"
        )
    if outcome not in env.outcomes:
        raise AgentResultError(
            f"AgentResult.outcome={outcome!r} is not one of the env's outcomes: "
            f"{', '.join(map(str, env.outcomes))}"
        )
    if not isinstance(result.info, dict):
        raise AgentResultError(f"AgentResult.info must be a dict, not {type(result.info).__name__}")
    return result


def _fill(episode: Episode, session: Any, result: AgentResult | None, reward_range: tuple) -> None:
    """The session's trajectory, calls and mismatch report, and the agent's verdict."""
    episode.token_ids = list(session.token_ids)
    episode.loss_mask = list(session.loss_mask)
    episode.logprobs = list(session.logprobs)
    episode.messages = session.trajectory_messages()
    episode.turns = [
        Turn(c.prompt_ids, c.completion_ids, c.logprobs, c.text, c.finish_reason)
        for c in session.calls
    ]
    info: dict[str, Any] = dict(result.info) if result is not None else {}
    info["calls"] = len(session.calls)
    info["trajectory_calls"] = session.trajectory_calls
    if session.mismatch is not None:
        info["token_mismatch"] = session.mismatch
    cut = [i for i, c in enumerate(session.calls) if c.finish_reason == "length"]
    if episode.outcome == ENV_ERROR and cut:
        # the agent failed on a reply the token limit cut (a forced call comes back with
        # no tool_calls): the policy's fault, scored as the env's lowest reward
        info["truncated"] = f"reply {cut[0] + 1} hit the token limit; the agent then raised"
        info["agent_error"] = (episode.error or "")[-1000:]
        episode.outcome, episode.error = TRUNCATED, None
        episode.reward = float(reward_range[0])
    elif episode.outcome == ENV_ERROR:
        episode.reward = 0.0
    elif session.truncated is not None:
        info["truncated"] = session.truncated
        episode.outcome = TRUNCATED
        low, high = reward_range
        episode.reward = float(result.reward) if result is not None else min(max(0.0, low), high)
    else:
        assert result is not None
        episode.outcome, episode.reward = result.outcome, float(result.reward)
    episode.info = info


def _traceback(err: BaseException) -> str:
    if isinstance(err, AgentResultError):
        return f"AgentResultError: {err}"
    return "".join(traceback.format_exception(type(err), err, err.__traceback__))[-4000:]
