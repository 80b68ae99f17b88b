"""Reference rows: an OpenAI-compatible endpoint (the API model a trained model would
replace, or `looprl serve` of any model) played on an env's held-out tasks.

`looprl eval --endpoint URL --model NAME --out ref.json` plays the same held-out tasks,
in the same order and with the same per-episode seeds as a run's sampled eval, through
the official `openai` client: the env's tools, its forced `tool_choice` and its
`response_format` go into each request as they are. The endpoint gives text, not token
ids, so these episodes have messages, rewards and outcomes but no tokens; they are for
the report, never for training.

Each finished episode is appended to `ref.episodes.jsonl` at once; a rerun of the same
command keeps those and asks only for the rest (an endpoint that fails mid-way loses
nothing). A reply the endpoint cut at `rollout.max_new_tokens` without a valid call is
`truncated`, with the env's lowest reward, as in a rollout. `eval.references: [ref.json]`
in a run config puts the row in the report, paired against the trained model.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from looprl.chat.parsers import validate_arguments
from looprl.config import Config
from looprl.envs import Environment, capabilities, make_env, solved_outcomes
from looprl.envs.common import check_reward, lowest_reward
from looprl.errors import ConfigError, EndpointError
from looprl.loop.evaluate import check_some_scored, episodes_path, eval_result
from looprl.loop.log import episode_record
from looprl.loop.progress import Progress
from looprl.loop.rollout import mark_env_error
from looprl.seeds import turn_seed
from looprl.types import TRUNCATED, Episode, Message, Task, ToolCall


def run_remote_eval(
    cfg: Config,
    endpoint: str,
    model: str,
    out: Path,
    api_key_env: str = "OPENAI_API_KEY",
    concurrency: int = 4,
    progress: Progress | None = None,
) -> dict:
    """Play the held-out eval against `endpoint`; write `out` (an EvalResult with
    `endpoint`) and `out.episodes.jsonl`; return the EvalResult."""
    from looprl.loop import preflight

    progress = progress or Progress()
    probe = make_env(cfg.env.name, cfg.env.args)
    preflight.check_env(cfg, probe)
    if capabilities(probe).agent:
        raise ConfigError(
            f"{cfg.env.name} is an agent environment: point its agent at the endpoint "
            "itself; looprl eval --endpoint plays environments with reset and step"
        )
    if capabilities(probe).group_judge:
        raise ConfigError(
            "looprl eval --endpoint scores episode by episode: a judge with "
            "mode: group is not supported there; use mode: pointwise"
        )
    _check_resumable(out, endpoint, model)
    client = _client(endpoint, api_key_env)
    tasks = probe.tasks("eval", n=cfg.eval.tasks, seed=cfg.eval.seed)
    repeated = [t for t in tasks for _ in range(cfg.eval.samples_per_task)]
    log_path = episodes_path(out)
    kept = _kept(log_path, repeated)
    todo = [i for i in range(len(repeated)) if i not in kept]
    episodes: dict[int, Episode] = {i: _from_record(r, repeated[i]) for i, r in kept.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    title = f"reference eval: {model}" + (f" ({len(kept)} kept)" if kept else "")
    with (
        progress.phase(title, len(repeated), "episode", len(kept), concurrent=True) as phase,
        log_path.open("a") as log,
    ):
        pool = ThreadPoolExecutor(max_workers=max(1, concurrency))
        futures = {
            pool.submit(play_remote, repeated[i], cfg, client, model, cfg.eval.seed + i): i
            for i in todo
        }
        try:
            for future in as_completed(futures):
                i, episode = futures[future], future.result()
                episodes[i] = episode
                log.write(json.dumps({"index": i, **episode_record(episode)}) + "\n")
                log.flush()  # written as it finishes: a crash after this keeps it
                phase.update(advance=1)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown()
        ordered = [episodes[i] for i in range(len(repeated))]
        solved = solved_outcomes(probe)
        result = eval_result(
            ordered, cfg.env.name, model, cfg.eval.seed, cfg.eval.temperature, solved
        )
        result["endpoint"] = endpoint
        # the endpoint's own token counts: its episodes hold no token ids
        scored = [e for e in ordered if e.outcome != "env_error"]
        result["response_len"] = sum(e.info.get("completion_tokens", 0) for e in scored) / max(
            len(scored), 1
        )
        phase.done(f"reward {result['reward_mean']:+.3f} · {result['n']} episodes")
    check_some_scored(ordered, "reference eval", log_path)
    out.write_text(json.dumps(result, indent=2))
    return result


def _check_resumable(out: Path, endpoint: str, model: str) -> None:
    """`out` and its episodes from another model (a local `looprl eval --out`, another
    endpoint): a rerun keeps the episodes beside `out`, and would pass theirs off as this
    endpoint's."""
    log_path = episodes_path(out)
    if not (out.is_file() and log_path.exists()):
        return
    try:
        earlier = json.loads(out.read_text())
    except (OSError, json.JSONDecodeError):
        return  # not an EvalResult: nothing says whose episodes they are
    if not isinstance(earlier, dict):
        return
    whose = (earlier.get("endpoint"), earlier.get("model"))
    if whose != (endpoint, model):
        played = f"{whose[1]} at {whose[0]}" if whose[0] else f"{whose[1]} (a local model)"
        raise ConfigError(
            f"{out} and {log_path} hold an eval of {played}, not of {model} at {endpoint}: "
            "an endpoint eval resumes from the episodes beside --out, and would take those "
            "for its own; give another --out, or delete both files"
        )


def _client(endpoint: str, api_key_env: str) -> Any:
    try:
        import openai
    except ImportError:
        raise ConfigError(
            "looprl eval --endpoint needs the openai client: pip install openai"
        ) from None
    key = os.environ.get(api_key_env) or "none"  # a local server takes any key
    return openai.OpenAI(base_url=endpoint, api_key=key, max_retries=3, timeout=120)


def _kept(path: Path, tasks: list[Task]) -> dict[int, dict]:
    """The episodes an earlier run of the same command finished (same index and task)."""
    if not path.exists():
        return {}
    kept = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a crash
        i = record.get("index")
        if isinstance(i, int) and i < len(tasks) and record.get("task_id") == tasks[i].id:
            kept[i] = record
    return kept


def _from_record(record: dict, task: Task) -> Episode:
    return Episode(
        task=task,
        messages=[],
        token_ids=[],
        loss_mask=[],
        logprobs=[],
        reward=float(record["reward"]),
        outcome=record["outcome"],
        info=record.get("info") or {},
        error=record.get("error"),
    )


def play_remote(task: Task, cfg: Config, client: Any, model: str, seed: int) -> Episode:
    """One episode of `task` with the endpoint's model as the policy."""
    env = make_env(cfg.env.name, cfg.env.args)
    episode = Episode(
        task=task,
        messages=[],
        token_ids=[],
        loss_mask=[],
        logprobs=[],
        temperature=cfg.eval.temperature,
    )
    try:
        obs = env.reset(task)
    except Exception as err:
        mark_env_error(episode, err)
        return episode
    history = list(obs.messages)
    episode.messages = history
    episode.outcome = TRUNCATED  # unless the env ends it within max_turns
    generated: list[int] = []  # the endpoint's completion tokens a turn (its usage)
    _play_turns(env, episode, history, obs, cfg, client, model, seed, generated)
    episode.info["completion_tokens"] = sum(generated)
    return episode


def _play_turns(
    env: Environment,
    episode: Episode,
    history: list[Message],
    obs: Any,
    cfg: Config,
    client: Any,
    model: str,
    seed: int,
    generated: list[int],
) -> None:
    for turn in range(env.max_turns):
        reply, cut, tokens = _ask(client, model, history, obs, cfg, turn_seed(seed, turn))
        generated.append(tokens)
        history.append(reply)
        if cut and not (reply.tool_calls and not reply.parse_failure):
            episode.outcome, episode.reward = TRUNCATED, lowest_reward(env)
            episode.info = {"truncated": "the endpoint's reply hit rollout.max_new_tokens"}
            return
        try:
            result = env.step(reply)
            check_reward(env, result.reward)
        except Exception as err:
            mark_env_error(episode, err)
            return
        episode.reward, episode.info = float(result.reward), dict(result.info)
        history.extend(result.messages)
        if result.done:
            episode.outcome = result.outcome or "done"
            return


def _ask(
    client: Any, model: str, history: list[Message], obs: Any, cfg: Config, seed: int
) -> tuple[Message, bool, int]:
    """The endpoint's reply as a parsed assistant message, whether it was cut, and its
    completion tokens (0 when the endpoint reports no usage)."""
    import openai

    request: dict[str, Any] = {
        "model": model,
        "messages": [_wire(m) for m in history],
        "temperature": cfg.eval.temperature,
        "max_tokens": cfg.rollout.max_new_tokens,
        "seed": seed,
    }
    if cfg.rollout.top_p < 1:
        request["top_p"] = cfg.rollout.top_p
    if obs.tools and obs.tool_choice != "none":
        request["tools"] = obs.tools
        choice = obs.tool_choice
        request["tool_choice"] = (
            choice
            if choice in ("auto", "required")
            else {"type": "function", "function": {"name": choice}}
        )
    if obs.response_format is not None:
        request["response_format"] = obs.response_format
    try:
        response = client.chat.completions.create(**request)
    except openai.OpenAIError as err:
        raise EndpointError(f"the endpoint refused or failed a request: {err}") from None
    choice = response.choices[0]
    tokens = getattr(getattr(response, "usage", None), "completion_tokens", None) or 0
    return _parsed(choice.message, obs), choice.finish_reason == "length", int(tokens)


def _wire(message: Message) -> dict[str, Any]:
    """A message as the chat completions API takes it (arguments as JSON text)."""
    out = message.to_dict()
    for i, call in enumerate(out.get("tool_calls") or []):
        call.setdefault("id", f"call_{i}")
        call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    return out


def _parsed(reply: Any, obs: Any) -> Message:
    """The reply's calls decoded and checked against the tools, as the chat layer checks a
    local model's: a failure is a parse-failure outcome, never an exception."""
    message = Message("assistant", reply.content or "")
    required = bool(obs.tools) and obs.tool_choice not in ("auto", "none")
    for call in reply.tool_calls or []:
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except json.JSONDecodeError as err:
            message.parse_failure, message.parse_detail = "bad_json", str(err)
            return message
        tool_call = ToolCall(call.function.name, arguments, id=call.id)
        problem = validate_arguments(tool_call, obs.tools)
        if problem is not None:
            unknown = problem.startswith("unknown tool")
            message.parse_failure = "unknown_tool" if unknown else "bad_arguments"
            message.parse_detail = problem
            return message
        message.tool_calls.append(tool_call)
    if required and not message.tool_calls:
        message.parse_failure = "no_tool_call"
    return message
