"""Expert episodes: an environment's demonstration played through it and recorded as an
episode of the policy would be.

Two places use them: the SFT warm start (loop/sft.py: the demonstration is trained on
with cross-entropy) and expert guidance in RL (`algo.expert_samples: k`): in each group
`group_size − k` episodes are sampled from the policy and k are the task's expert episode,
which takes its group-relative advantage like any other member (mixed-policy GRPO, LUFFY,
arXiv 2504.14945). Where the policy's samples already do as well as the expert, the
group's rewards are equal and the expert adds nothing; where they do worse, the expert's
advantage is positive and theirs negative, so the signal sits on the tasks the policy gets
wrong, without any extra generation. The policy's own samples rarely show a better move
it does not already prefer (docs/learning/ablations.md); the expert always does.

An expert episode has no sampling logprobs: the update takes the trainer's own logprobs
before the step as its behaviour policy (`Episode.expert`, loop/update.py), so its ratio
starts at 1 like a sampled episode's, and it is left out of the engine-vs-trainer gap, of
truncated importance sampling and of the step's `rollout/*` metrics, which describe the
policy's samples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from looprl.chat import ChatRenderer
from looprl.engine.requests import generation_request
from looprl.envs import Environment, demonstrations
from looprl.errors import EnvError
from looprl.loop.rollout import append_tokens, mark_env_error
from looprl.types import TRUNCATED, Episode, Task, Turn


def expert_episode(
    env: Environment, task: Task, renderer: ChatRenderer, temperature: float = 1.0
) -> Episode:
    """`task` played with the env's demonstration messages: token ids as a rollout would
    record them (loss mask 1 on each call's tokens, logprobs 0), one `Turn` per call with
    the grammar a forced call is sampled under, the env's reward, outcome and per-turn
    rewards. Raises what the environment raises (and EnvError without demonstrations)."""
    demos = demonstrations(env, task)
    if not demos:
        raise EnvError(
            f"environment {type(env).__name__} has no demonstrations for task {task.id}; "
            "sft.enabled and algo.expert_samples need an environment with a "
            "demonstrations(task) method"
        )
    obs = env.reset(task)
    history = list(obs.messages)
    episode = Episode(
        task=task,
        messages=history,
        token_ids=[],
        loss_mask=[],
        logprobs=[],
        temperature=temperature,
        expert=True,
    )
    append_tokens(episode, renderer.prompt_ids(history, obs.tools), mask=0)
    constraint = generation_request([], obs.tools, obs.tool_choice, renderer.format).constraint
    result = None
    for demo in demos:
        completion = renderer.assistant_ids(demo)
        episode.turns.append(
            Turn(
                prompt_ids=list(episode.token_ids),
                completion_ids=list(completion),
                completion_logprobs=[0.0] * len(completion),
                text=renderer.decode(completion),
                constraint=constraint,
            )
        )
        append_tokens(episode, completion, mask=1)
        history.append(demo)
        result = env.step(demo)
        episode.reward, episode.info = float(result.reward), dict(result.info)
        if result.turn_reward is not None:
            episode.turn_rewards.append(float(result.turn_reward))
        if result.done:
            history.extend(result.messages)
            break
        more = renderer.continuation_ids(history, result.messages, obs.tools, completion)
        history.extend(result.messages)
        append_tokens(episode, more, mask=0)
    done = result is not None and result.done
    episode.outcome = (result.outcome or "done") if done else TRUNCATED
    return episode


def safe_expert_episode(
    make_env: Callable[[], Any], task: Task, renderer: ChatRenderer, temperature: float
) -> Episode:
    """`expert_episode` in a fresh env; an env that raises ends this episode only, with
    outcome `env_error` (counted against `env.error_budget`, never trained on)."""
    try:
        return expert_episode(make_env(), task, renderer, temperature)
    except Exception as err:
        episode = Episode(
            task=task,
            messages=[],
            token_ids=[],
            loss_mask=[],
            logprobs=[],
            temperature=temperature,
            expert=True,
        )
        mark_env_error(episode, err)
        return episode


def expert_advantage(batch: list[tuple[Episode, Any]]) -> float:
    """`train/expert_advantage`: the mean advantage of the step's expert episodes (a
    per-turn advantage counts as its turns' mean); 0 without any. It falls toward 0 as the
    policy's samples catch up with the expert on the tasks played."""
    return mean_advantage([a for e, a in batch if e.expert])


def mean_advantage(advantages: list[Any]) -> float:
    """The mean of episode advantages (a per-turn advantage counts as its turns' mean); 0
    without any."""
    values = [sum(a) / len(a) if isinstance(a, tuple) else float(a) for a in advantages]
    return sum(values) / len(values) if values else 0.0
