"""On-policy distillation's teacher behind an OpenAI-compatible server: `algo.teacher:
http://HOST:PORT/v1`, with `#MODEL` after it for the served model's name (default: the
first model the server lists at /v1/models). `looprl serve TEACHER` or vLLM's
`vllm serve TEACHER` serve one (docs/training.md).

The teacher's log-prob of each token the student sampled comes from `POST
/v1/completions` with the episode's token ids as the prompt, `echo: true`, `logprobs: 0`
and `max_tokens: 1`: the legacy completions answer then starts `logprobs.token_logprobs`
with the prompt's own tokens (the first null), each scored given the tokens before it,
at temperature 1. `looprl serve` and vLLM's server both answer this form. One request per
episode, `IN_FLIGHT` of them at a time (the server batches them); a request that fails
or times out stops the update with an `EndpointError` naming the URL (the step's
checkpoints before it are kept; `looprl run --resume` continues).

Before anything is written, `ServerTeacher.connect` asks the server for its models and
probes its tokenizer with a fixed text: sent as text, it must come back as the student's
tokens (their count and texts); sent as the student's token ids, as the same texts; and
the two must score alike (a token of the same text under another id, an added token,
scores otherwise). Distillation compares the log-probs of the same token ids; a server
with another tokenizer is refused with the first difference. The
server scores at temperature 1, so a student sampling at another temperature is refused
by the config (config/run.py).
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from looprl.errors import ConfigError, EndpointError
from looprl.types import Episode

IN_FLIGHT = 8  # requests sent at once
TIMEOUT_S = 600.0  # one episode's scoring; a CPU server under load takes seconds
# plain ASCII: servers render a token's text alike there (special tokens and partial
# UTF-8 bytes come back differently from server to server)
PROBE_TOLERANCE = 0.01  # the same ids scored twice: equal to the server's rounding
PROBE_TEXT = 'On-policy distillation: the teacher scores 12 tokens, {"square": 5}.\n'


def is_server(spec: str | None) -> bool:
    """Whether `algo.teacher` names a server (an http(s) URL) rather than a model."""
    return bool(spec) and str(spec).startswith(("http://", "https://"))


def split_url(spec: str) -> tuple[str, str | None]:
    """'http://h:p/v1#name' → ('http://h:p/v1', 'name'); no '#': the name is None."""
    url, _, model = spec.partition("#")
    return url.rstrip("/"), model or None


@dataclass
class ServerTeacher:
    """The teacher's log-probs of episodes' tokens, from the server at `url` (module doc)."""

    url: str  # the base URL, ending in /v1
    model: str  # the served model's name

    @classmethod
    def connect(cls, spec: str, tokenizer: Any) -> ServerTeacher:
        """The server's model (checked against /v1/models), its tokenizer probed."""
        url, wanted = split_url(spec)
        listed = [m.get("id") for m in (_request(url, "/models", None, 30.0).get("data") or [])]
        if not listed:
            raise ConfigError(f"algo.teacher: {url}/models lists no model")
        if wanted is not None and wanted not in listed:
            raise ConfigError(
                f"algo.teacher: {url} does not serve {wanted!r}; it serves "
                f"{', '.join(map(str, listed))} (name one after '#')"
            )
        teacher = cls(url, wanted or str(listed[0]))
        teacher.check_tokenizer(tokenizer)
        return teacher

    def echo(self, prompt: str | list[int], timeout_s: float = TIMEOUT_S) -> dict:
        """The logprobs object of the prompt echoed with its own tokens' log-probs."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": 1,
            "echo": True,
            "logprobs": 0,
            "temperature": 1.0,
        }
        reply = _request(self.url, "/completions", body, timeout_s)
        try:
            return reply["choices"][0]["logprobs"]
        except (KeyError, IndexError, TypeError):
            raise EndpointError(
                f"algo.teacher: {self.url}/completions answered without logprobs for an echoed "
                f"prompt ({json.dumps(reply)[:300]}); the server must support echo with logprobs"
            ) from None

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Refuse a server whose tokenizer is not the student's (module doc): the probe
        text sent as text must come back as the student's tokens (their count and texts),
        and score as the student's token ids of it do (equal texts with other ids, an
        added token, score otherwise)."""
        by_text = self.echo(PROBE_TEXT, 60.0)
        texts = list(by_text.get("tokens") or [])[:-1]  # less the one generated token
        plain = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
        full = tokenizer(PROBE_TEXT)["input_ids"]  # a server may add a BOS to a text
        ids = full if len(full) == len(texts) else plain
        mine = [tokenizer.decode([i]) for i in ids]
        if texts != mine:
            self._refuse("as text", texts, mine, _first_difference(texts, mine))
        by_ids = self.echo(ids, 60.0)
        as_ids = list(by_ids.get("tokens") or [])[: len(ids)]
        if as_ids != mine:
            self._refuse("as token ids", as_ids, mine, _first_difference(as_ids, mine))
        for t, (a, b) in enumerate(zip(by_text["token_logprobs"], by_ids["token_logprobs"])):
            if t < len(ids) and a is not None and b is not None and abs(a - b) > PROBE_TOLERANCE:
                self._refuse("as text and as token ids", texts, mine, t, (a, b))

    def _refuse(
        self, how: str, theirs: list, mine: list, at: int, scores: tuple | None = None
    ) -> None:
        said = (
            f"it scores the same texts as other token ids (at token {at}, "
            f"{mine[at]!r}: {scores[0]:.4f} sent as text, {scores[1]:.4f} as the student's ids)"
            if scores
            else f"the probe text sent {how} came back as {len(theirs)} tokens, the student's "
            f"are {len(mine)}; the first difference at token {at}: "
            f"{theirs[at : at + 3]!r} against {mine[at : at + 3]!r}"
        )
        raise ConfigError(
            f"algo.teacher: the server at {self.url} ({self.model}) tokenizes otherwise than "
            f"the student: {said}. On-policy distillation compares the log-probs of the same "
            "token ids: serve a teacher of the student's family (the same tokenizer)"
        )

    def masked_values(self, episodes: list[Episode]) -> list[torch.Tensor]:
        """Each episode's teacher log-probs at its generated (loss-masked) tokens, in order:
        what loop/update.py's `Scorer.masked_values` gives for a local teacher."""
        with ThreadPoolExecutor(max_workers=IN_FLIGHT) as pool:
            return list(pool.map(self.episode_values, episodes))

    def episode_values(self, episode: Episode) -> torch.Tensor:
        ids, mask = list(episode.token_ids), list(episode.loss_mask)
        scores = self.echo(ids).get("token_logprobs") or []
        if len(scores) < len(ids):
            raise EndpointError(
                f"algo.teacher: {self.url} scored {len(scores)} of an episode's {len(ids)} "
                "tokens; the server must echo the whole prompt with logprobs"
            )
        values = [scores[t] for t in range(len(ids)) if mask[t]]
        if any(v is None or not math.isfinite(v) for v in values):
            raise EndpointError(f"algo.teacher: {self.url} gave a sampled token no finite logprob")
        return torch.tensor(values, dtype=torch.float32)


def _first_difference(theirs: list, mine: list) -> int:
    return next(
        (i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b), min(len(theirs), len(mine))
    )


def _request(url: str, path: str, body: dict | None, timeout_s: float) -> Any:
    """GET (body None) or POST JSON to url + path; an EndpointError naming the URL."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:500]
        raise EndpointError(
            f"algo.teacher: {url}{path} answered HTTP {err.code}: {detail}"
        ) from None
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise EndpointError(
            f"algo.teacher: {url}{path} failed ({err}); is the teacher's server up? A run it "
            "stopped keeps its checkpoints: `looprl run RUN --resume` continues it"
        ) from None
