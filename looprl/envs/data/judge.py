"""The `judge` scorer: a model grades each reply against a rubric, for work without a checker.

    scorers:
      - name: judge
        rubric: "10 if the reply answers the question politely and correctly, 0 if ..."
        endpoint: http://127.0.0.1:8000/v1     # any OpenAI-compatible server (`looprl serve`)
        model: judge                          # the endpoint's model name
        api_key_env: OPENAI_API_KEY           # where the key is (a local server takes any)

Pointwise: the judge sees the rubric, the task's prompt, the row's answer when it has one,
and the reply, and returns `{"reason": "...", "score": 0..10}` under a JSON schema (an
integer scale, which judges keep more consistently than a fraction; the score is it / 10).
A verdict is cached by its content (model, rubric, prompt, answer, reply): in memory, and
in the run folder's `judge_cache.jsonl` during `looprl run` (a resumed run re-asks
nothing). A request that fails or a verdict that does not parse is retried with backoff
(`retries`, 1 s, 2 s, 4 s, ...); a judge that keeps failing raises, so the episode is an
`env_error`: counted against `env.error_budget`, left out of the loss, never a silent 0.
Each verdict's reason, time and cache use are in the episode's `info` (`judge`), and the
run's metrics sum the calls and seconds (`judge/calls`, `judge/seconds`).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from looprl.envs.common import reward_label
from looprl.envs.data.score_types import Score, as_text
from looprl.errors import EnvError

VERDICT = {
    "type": "object",
    # a bounded reason: a verdict always fits the judge's max_tokens
    "properties": {
        "reason": {"type": "string", "maxLength": 200},
        "score": {"enum": list(range(11))},  # 0..10, a bounded answer; the score is it / 10
    },
    "required": ["reason", "score"],
    "additionalProperties": False,
}
INSTRUCTIONS = (
    "You grade a reply to a task. Follow the rubric exactly. Answer with a JSON object: "
    '{"reason": "<one sentence>", "score": <an integer from 0 (fails the rubric) to 10 '
    "(meets it fully)>}."
)

_cache: dict[str, dict[str, Any]] = {}
_cache_dir: Path | None = None  # the run folder during `looprl run` (cache_verdicts_in)
_loaded: set[Path] = set()  # cache files read into _cache
_clients: dict[tuple[str, str], Any] = {}
_lock = threading.Lock()


class Judge:
    """A pointwise judge; called as a scorer: `judge(response, answer, row) -> Score`."""

    remote = True  # asks a model: not run on every row when the data file is checked

    def __init__(
        self,
        rubric: str | None = None,
        endpoint: str | None = None,
        model: str | None = None,
        api_key_env: str = "OPENAI_API_KEY",
        retries: int = 3,
        max_tokens: int = 512,
        timeout_s: float = 120.0,
    ) -> None:
        for key, value in (("rubric", rubric), ("endpoint", endpoint), ("model", model)):
            if not isinstance(value, str) or not value.strip():
                raise EnvError(f"the judge scorer needs {key}: a non-empty string")
        if not isinstance(retries, int) or retries < 0:
            raise EnvError(f"judge retries={retries!r} is invalid: expected an integer >= 0")
        self.rubric, self.endpoint, self.model = rubric, endpoint, model
        self.api_key_env, self.retries = api_key_env, retries
        self.max_tokens, self.timeout_s = max_tokens, timeout_s
        self.last: dict[str, Any] = {}  # the last verdict's details, for the episode's info

    def __call__(self, response: Any, answer: Any, row: dict) -> Score:
        prompt = row.get("prompt_text", "")
        verdict = self.verdict(
            [prompt, answer, as_text(response)], lambda: self._ask(prompt, answer, response)
        )
        score = min(1.0, max(0.0, float(verdict["score"]) / 10))
        return Score(score, reward_label(score))

    def verdict(self, content: list[Any], ask: Any) -> dict[str, Any]:
        """The cached verdict on `content` (with the model and rubric), else `ask()`'s,
        remembered; `last` says how it was had."""
        key = hashlib.sha256(
            json.dumps([self.model, self.rubric, *content], sort_keys=True, default=str).encode()
        ).hexdigest()
        started = time.perf_counter()
        verdict, cached = _cached(key), True
        if verdict is None:
            verdict, cached = ask(), False
            _remember(key, verdict)
        self.last = {
            "reason": verdict.get("reason", ""),
            "cached": cached,
            "seconds": time.perf_counter() - started,
            "calls": 0 if cached else verdict["calls"],
        }
        return verdict

    def _ask(self, prompt: str, answer: Any, response: Any) -> dict[str, Any]:
        user = f"Rubric:\n{self.rubric}\n\nTask:\n{prompt}\n\n"
        if answer is not None:
            user += f"Reference answer:\n{as_text(answer)}\n\n"
        user += f"Reply to grade:\n{as_text(response)}"
        return self._request(
            INSTRUCTIONS, user, VERDICT, lambda v: isinstance(v.get("score"), int | float)
        )

    def _request(self, system: str, user: str, schema: dict, valid: Any) -> dict[str, Any]:
        """The verdict (a JSON object `valid` accepts, with `calls`), retried with backoff."""
        request = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "verdict", "schema": schema},
            },
        }
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(2.0 ** (attempt - 1), 30.0))
            try:
                reply = self.client().chat.completions.create(**request)
                verdict = json.loads(reply.choices[0].message.content or "")
                if not isinstance(verdict, dict) or not valid(verdict):
                    raise ValueError(f"not a verdict of the schema: {verdict!r:.120}")
                return {**verdict, "calls": attempt + 1}
            except Exception as err:  # the endpoint's errors and unparsable verdicts alike
                problem = f"{type(err).__name__}: {str(err)[:300]}"
        raise EnvError(
            f"the judge ({self.model} at {self.endpoint}) failed {self.retries + 1} times; "
            f"the last: {problem}"
        )

    def client(self) -> Any:
        """One client per endpoint and key, shared by every episode's judge."""
        key = os.environ.get(self.api_key_env) or "none"  # a local server takes any key
        with _lock:
            if (self.endpoint, key) not in _clients:
                try:
                    import openai
                except ImportError:
                    raise EnvError(
                        "the judge needs the openai client: pip install openai"
                    ) from None
                _clients[self.endpoint, key] = openai.OpenAI(
                    base_url=self.endpoint, api_key=key, max_retries=0, timeout=self.timeout_s
                )
            return _clients[self.endpoint, key]


class GroupJudge(Judge):
    """A group-relative judge (`mode: group`): the replies to one task, sampled together,
    are shown to the judge at once and scored against each other (each 0..10 under a JSON
    schema of exactly that many scores), as ART's RULER does. Scored by the loop after a
    group is played (`Dataset.score_groups`), not episode by episode."""

    group = True

    def __call__(self, response: Any, answer: Any, row: dict) -> Score:
        raise EnvError("a group judge scores whole groups (Dataset.score_groups)")

    def rank(self, prompt: str, answer: Any, replies: list[Any]) -> list[float]:
        """Each reply's score in [0, 1], judged side by side; cached by content."""
        verdict = self.verdict(
            [prompt, answer, [as_text(r) for r in replies]],
            lambda: self._ask_group(prompt, answer, replies),
        )
        return [min(1.0, max(0.0, float(s) / 10)) for s in verdict["scores"]]

    def _ask_group(self, prompt: str, answer: Any, replies: list[Any]) -> dict[str, Any]:
        n = len(replies)
        user = f"Rubric:\n{self.rubric}\n\nTask:\n{prompt}\n\n"
        if answer is not None:
            user += f"Reference answer:\n{as_text(answer)}\n\n"
        user += "\n\n".join(f"Reply {i + 1}:\n{as_text(r)}" for i, r in enumerate(replies))
        schema = {
            "type": "object",
            "properties": {
                "reason": {"type": "string", "maxLength": 300},
                "scores": {
                    "type": "array",
                    "items": {"enum": list(range(11))},
                    "minItems": n,
                    "maxItems": n,
                },
            },
            "required": ["reason", "scores"],
            "additionalProperties": False,
        }
        instructions = (
            f"You grade {n} replies to the same task against each other. Follow the rubric "
            'exactly. Answer with a JSON object: {"reason": "<one sentence>", "scores": '
            f"[<{n} integers from 0 to 10, one per reply, in order>]}}. Better replies get "
            "higher scores; use the whole scale."
        )
        return self._request(instructions, user, schema, lambda v: len(v.get("scores", [])) == n)


def cache_verdicts_in(run_dir: Path | None) -> None:
    """Keep verdicts in `run_dir`/judge_cache.jsonl from now on (None: in memory only);
    `looprl run` sets its run folder, and unsets it when it ends."""
    global _cache_dir
    _cache_dir = run_dir


def _cache_file() -> Path | None:
    return _cache_dir / "judge_cache.jsonl" if _cache_dir is not None else None


def _cached(key: str) -> dict[str, Any] | None:
    with _lock:
        path = _cache_file()
        if path is not None and path not in _loaded and path.exists():
            _loaded.add(path)
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                    _cache.setdefault(record["key"], record["verdict"])
                except (ValueError, KeyError, TypeError):
                    continue  # a line torn by a crash
        return _cache.get(key)


def _remember(key: str, verdict: dict[str, Any]) -> None:
    with _lock:
        _cache[key] = verdict
        path = _cache_file()
        if path is not None and path.parent.exists():
            with path.open("a") as f:
                f.write(json.dumps({"key": key, "verdict": verdict}) + "\n")
