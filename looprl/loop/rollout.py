"""Rollouts: drive many episodes at once through the engine and their environments.

Token-in/token-out: an episode's `token_ids` only ever grow by appending. The sampled
completion ids go in as they are (loss mask 1, with their sampling logprobs); the
environment's reply is rendered by the chat layer into the ids that continue the
conversation (loss mask 0). Every live episode's next model call is batched together.

What the model wrote stays in the record as it was sampled, thinking included, although
the chat templates of reasoning models drop earlier turns' thinking when they render a
conversation: in a later turn the model sees its own earlier thinking, as it does not
when served. An episode whose later prompt differs from the template's rendering of the
same conversation says where (`info["retokenize_mismatch"]`, counted per step as
`rollout/retokenize_mismatch`).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from looprl.chat import ChatRenderer
from looprl.engine import GenerationRequest, RolloutEngine, SamplingParams, Thinking
from looprl.engine.requests import generation_request
from looprl.envs import Environment
from looprl.envs.common import check_reward, lowest_reward
from looprl.seeds import turn_seed
from looprl.types import ENV_ERROR, TRUNCATED, Episode, Message, Observation, Task, Turn


@dataclass
class _Live:
    """An episode in progress: its environment, conversation and token record."""

    env: Environment
    episode: Episode
    obs: Observation
    history: list[Message] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)  # len(history) as each turn began
    stream: int = 0  # the random stream it samples from in every turn (run_episodes)
    ended: bool = False  # counted by _Ended


def mark_env_error(episode: Episode, err: BaseException) -> None:
    """A bug inside the environment: this episode only is marked and left out of the loss."""
    episode.outcome = ENV_ERROR
    episode.reward = 0.0
    episode.error = "".join(traceback.format_exception(type(err), err, err.__traceback__))[-4000:]


def _start(
    task: Task, make_env: Callable[[], Any], renderer: ChatRenderer, temperature: float
) -> _Live:
    env = make_env()
    episode = Episode(
        task=task, messages=[], token_ids=[], loss_mask=[], logprobs=[], temperature=temperature
    )
    live = _Live(env=env, episode=episode, obs=Observation(messages=[], tools=[]))
    try:
        live.obs = env.reset(task)
    except Exception as err:
        mark_env_error(live.episode, err)
        return live
    live.history = list(live.obs.messages)
    prompt = renderer.prompt_ids(live.history, live.obs.tools)
    append_tokens(episode, prompt, mask=0)
    return live


def append_tokens(
    episode: Episode, ids: list[int], mask: int, logprobs: list[float] | None = None
) -> None:
    episode.token_ids.extend(ids)
    episode.loss_mask.extend([mask] * len(ids))
    episode.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))


def _request(live: _Live, renderer: ChatRenderer, thinking: Thinking | None) -> GenerationRequest:
    """The episode's next model call: its whole token record so far as the prompt."""
    obs = live.obs
    live.turn_starts.append(len(live.history))
    return generation_request(
        live.episode.token_ids,
        obs.tools,
        obs.tool_choice,
        renderer.format,
        response_format=obs.response_format,
        thinking=thinking,
    )


def retokenize_mismatch(live: _Live, renderer: ChatRenderer) -> int | None:
    """Where the last turn's prompt (the record as sampled) first differs from the chat
    template's rendering of the conversation up to that turn; None when they agree or
    the episode had one turn."""
    ep = live.episode
    if len(ep.turns) < 2 or ep.outcome == ENV_ERROR:
        return None
    seen = ep.turns[-1].prompt_ids
    try:
        rendered = renderer.prompt_ids(live.history[: live.turn_starts[-1]], live.obs.tools)
    except Exception:  # a template that cannot render the conversation differs from it
        return 0
    if rendered == seen:
        return None
    return next((i for i, (a, b) in enumerate(zip(seen, rendered)) if a != b), len(seen))


def run_episodes(
    tasks: list[Task],
    make_env: Callable[[], Any],
    engine: RolloutEngine,
    renderer: ChatRenderer,
    params: SamplingParams,
    max_turns: int,
    max_episode_tokens: int,
    on_progress: Callable[[int], None] | None = None,
    first_index: int = 0,
    thinking: Thinking | None = None,
) -> list[Episode]:
    """Play one episode per entry of `tasks` (repeat a task for a group) and return them
    in the same order. Malformed model output is an outcome; an environment that raises
    ends only its own episode with outcome `env_error`. `on_progress(n)` hears how many
    episodes have ended, as they end (for a progress display; it changes nothing).

    Episode i samples from random stream `first_index + i` in every turn: a batch split
    over several processes (each passing its share's offset) samples what one process
    playing the whole batch would. `thinking` allows free text before forced calls."""
    lives = [_start(task, make_env, renderer, params.temperature) for task in tasks]
    for i, lv in enumerate(lives):
        lv.stream = first_index + i
    ended = _Ended(on_progress)
    for lv in lives:
        if lv.episode.outcome == ENV_ERROR:
            ended(lv)
    active = [lv for lv in lives if lv.episode.outcome != ENV_ERROR]
    turn = 0
    # an episode's next turn extends its last one: the engine keeps that KV meanwhile
    session = getattr(engine, "session", None)
    with session() if session is not None else nullcontext():
        while active:
            for lv in active:
                if len(lv.episode.token_ids) >= max_episode_tokens:
                    lv.episode.outcome = TRUNCATED
                    if not lv.episode.turns:  # the prompt alone fills the episode's tokens
                        lv.episode.reward = lowest_reward(lv.env)
                    ended(lv)
            active = [lv for lv in active if lv.episode.outcome != TRUNCATED]
            room = [max_episode_tokens - len(lv.episode.token_ids) for lv in active]
            if not active:
                break
            turn_params = replace(params, seed=turn_seed(params.seed, turn))
            requests = [_request(lv, renderer, thinking) for lv in active]
            for lv, request, left in zip(active, requests, room):
                request.stream = lv.stream
                request.max_new_tokens = min(params.max_new_tokens, left)
                request.keep_kv = turn + 1 < max_turns
                if on_progress is not None and not request.keep_kv:  # its last turn
                    request.on_complete = partial(ended, lv)
            completions = engine.generate(requests, turn_params)
            still: list[_Live] = []
            for lv, completion, request in zip(active, completions, requests):
                last = turn + 1 >= max_turns
                if _advance(lv, completion, renderer, last, request.constraint):
                    still.append(lv)
                else:
                    ended(lv)
            active = still
            turn += 1
    for lv in lives:
        lv.episode.messages = lv.history
        mismatch = retokenize_mismatch(lv, renderer)
        if mismatch is not None:
            lv.episode.info["retokenize_mismatch"] = mismatch
    return [lv.episode for lv in lives]


class _Ended:
    """Counts episodes as they end, each once, and tells `report` the count. An episode
    in its last allowed turn has ended as soon as its completion is ready: the engine
    says so (`on_complete`) before the whole batch is back."""

    def __init__(self, report: Callable[[int], None] | None) -> None:
        self.report = report
        self.count = 0

    def __call__(self, live: _Live) -> None:
        if self.report is not None and not live.ended:
            live.ended = True
            self.count += 1
            self.report(self.count)


def _advance(
    live: _Live, completion: Any, renderer: ChatRenderer, last_turn: bool, constraint: Any = None
) -> bool:
    """Record one completion (sampled under `constraint`, if any), let the environment
    answer; True if the episode goes on."""
    ep = live.episode
    text = renderer.decode(completion.ids)
    ep.turns.append(
        Turn(
            prompt_ids=list(ep.token_ids),
            completion_ids=list(completion.ids),
            completion_logprobs=list(completion.logprobs),
            text=text,
            finish_reason=completion.finish_reason,
            constraint=constraint,
            free=None if completion.free is None else list(completion.free),
        )
    )
    append_tokens(ep, completion.ids, mask=1, logprobs=completion.logprobs)
    message = renderer.assistant_message(
        text, live.obs.tools, require_call=bool(live.obs.tools) and live.obs.tool_choice != "none"
    )
    live.history.append(message)
    if completion.finish_reason == "length" and not (
        message.tool_calls and not message.parse_failure
    ):
        # the reply was cut by the token limit: the policy's fault, not a parse of what it
        # meant; scored as the env's lowest reward, and the env never sees the stub
        ep.outcome, ep.reward = TRUNCATED, lowest_reward(live.env)
        ep.info = {"truncated": f"the reply hit the token limit ({len(completion.ids)} tokens)"}
        return False
    try:
        result = live.env.step(message)
        check_reward(live.env, result.reward)
    except Exception as err:
        mark_env_error(live.episode, err)
        return False
    ep.reward = float(result.reward)
    ep.info = dict(result.info)
    if result.turn_reward is not None:
        ep.turn_rewards.append(float(result.turn_reward))
    if result.done or last_turn:
        live.history.extend(result.messages)
        ep.outcome = (result.outcome or "done") if result.done else TRUNCATED
        return False
    try:
        more = renderer.continuation_ids(
            live.history, result.messages, live.obs.tools, completion.ids
        )
    except Exception as err:
        mark_env_error(live.episode, err)
        return False
    live.history.extend(result.messages)
    append_tokens(ep, more, mask=0)
    return True
