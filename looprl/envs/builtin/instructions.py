"""Instruction following: write a short business text that obeys a few checkable rules.

A task is a writing job in one of four domains (a customer-support reply, a product
description, an incident summary, meeting notes) about a subject, in one of three
templates (`message`: plain prose, `bullets`: a list, `json`: a JSON object), with 2-4
rules stated plainly in the user prompt. The model answers in plain text: no tool, so
`reset` offers `tools=[]` and `tool_choice="none"`.

Every rule is a pure function `check(answer, spec) -> bool` in `CHECKS` (the rule is in
its docstring). Content checks ask for something to be present (`json_keys`, `include`,
`starts_with`, `ends_with`, `bullet_count`); restrictions forbid something (`max_words`,
`exclude`, `no_exclamation`) and so hold for almost any short answer. Each template has
one content check that shapes it; the other checks are drawn so that restrictions are
never more than half of a task's checks: an answer that says nothing earns at most 0.5.

    reward = satisfied checks / checks                   (in [0, 1])

Outcomes: `all_passed` (reward 1), `partial`, `none_passed` (reward 0) and `empty` (a blank
answer, reward 0 whatever the checks say). A message the chat layer marked as a parse
failure (a JSON answer with a "name" key looks like a tool call) is scored on its text
all the same; its label is kept in `info`, beside each check's pass/fail.

Tasks are drawn from word lists by `random.Random`; a hash of a task's content puts it
in the eval split (1 in 8) or the train split, so the splits can never share a task.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from looprl.envs.builtin.instruction_checks import (  # noqa: F401  (re-exported for users)
    CHECKS,
    RESTRICTIONS,
    RULES,
    check_spec,
    count_words,
    has_word,
    json_object,
)
from looprl.envs.common import in_progress
from looprl.errors import EnvError
from looprl.types import Message, Observation, StepResult, Task

# ------------------------------------------------------------------------------ domains


@dataclass(frozen=True)
class Domain:
    """Word lists of one domain. No forbidden word occurs in any of the other lists."""

    job: str  # the request, with {subject}
    intro: str  # the expert's first sentence, with {subject}
    subjects: tuple[str, ...]
    sentences: tuple[str, ...]  # expert sentences; [term] marks a word `include` may require
    forbidden: tuple[str, ...]
    json_keys: tuple[str, ...]
    openers: tuple[str, ...]
    closers: tuple[str, ...]

    @property
    def by_term(self) -> dict[str, str]:
        """Requirable term -> its expert sentence, brackets removed."""
        marked = {re.findall(r"\[(\w+)\]", s)[0].lower(): s for s in self.sentences}
        return {term: s.replace("[", "").replace("]", "") for term, s in marked.items()}


# fmt: off
DOMAINS: dict[str, Domain] = {
    "support": Domain(
        job="Write a reply to a customer about {subject}.",
        intro="Thanks for writing about {subject}.",
        subjects=("a late delivery", "a double charge", "a broken charger",
                  "a forgotten password", "a cancelled order", "a missing invoice"),
        sentences=("Your [order] is on its way.", "We have sent a full [refund].",
                   "Your [account] is safe and active.", "A new [invoice] is attached.",
                   "We will confirm by [email].", "We fixed this [today].",
                   "Our [team] checked every detail.", "We are glad to [help]."),
        forbidden=("sorry", "unfortunately", "policy", "cannot", "problem", "apologize"),
        json_keys=("greeting", "answer", "next_step", "closing"),
        openers=("Hello", "Hi there", "Dear customer"),
        closers=("Best regards", "Kind regards", "Thank you"),
    ),
    "product": Domain(
        job="Write a product description of our {subject}.",
        intro="Meet our {subject}.",
        subjects=("solar garden lamp", "folding bike", "steel water bottle",
                  "wool travel blanket", "smart kettle", "bamboo desk"),
        sentences=("It comes with a two-year [warranty].", "It is [light] and easy to carry.",
                   "Its [durable] build lasts for years.", "The [price] includes free shipping.",
                   "Its [design] is simple and clean.", "It makes a lovely [gift].",
                   "Every part is tested for [quality].", "It comes in three [colors]."),
        forbidden=("cheap", "best", "perfect", "amazing", "revolutionary", "guaranteed"),
        json_keys=("name", "tagline", "features", "audience"),
        openers=("Hello", "Good news"),
        closers=("Order today", "Thank you"),
    ),
    "incident": Domain(
        job="Write an incident summary of {subject}.",
        intro="This summary covers {subject}.",
        subjects=("the checkout outage", "the login failure", "the slow search",
                  "the payment delay", "the email backlog", "the expired certificate"),
        sentences=("We found the root [cause].", "The [impact] on users was limited.",
                   "Some [customers] saw slow pages.", "A [fix] is now live.",
                   "[Monitoring] alerted us quickly.", "The full [timeline] is in the log.",
                   "A [rollback] restored service.", "The [database] was overloaded."),
        forbidden=("blame", "fault", "careless", "disaster", "panic", "mistake"),
        json_keys=("title", "impact", "cause", "next_steps"),
        openers=("Hello team", "Summary"),
        closers=("Next update soon", "Thank you"),
    ),
    "meeting": Domain(
        job="Write meeting notes on {subject}.",
        intro="These notes cover {subject}.",
        subjects=("the budget review", "the product launch", "the hiring plan",
                  "the office move", "the quarterly planning", "the security training"),
        sentences=("The [budget] was approved.", "The [deadline] is next Friday.",
                   "Each task has one [owner].", "Every [action] item is tracked.",
                   "The final [decision] is recorded.", "Two [risks] were raised.",
                   "We followed the [agenda].", "All [attendees] joined on time."),
        forbidden=("maybe", "somehow", "basically", "stuff", "whatever", "probably"),
        json_keys=("topic", "decisions", "actions", "owners"),
        openers=("Hi all", "Notes"),
        closers=("See you soon", "Thanks all"),
    ),
}
# fmt: on

# template -> (the content check that shapes it, the kinds its other checks come from)
TEMPLATES: dict[str, tuple[str, tuple[str, ...]]] = {
    "message": ("include", ("starts_with", "ends_with", "max_words", "exclude", "no_exclamation")),
    "bullets": ("bullet_count", ("include", "max_words", "exclude", "no_exclamation")),
    "json": ("json_keys", ("include", "max_words", "exclude", "no_exclamation")),
}
MAX_CHECKS = 4
WORD_LIMITS = (40, 50, 60)  # every expert answer has at most 40 words


# ------------------------------------------------------------------------- task drawing


def _draw_check(kind: str, domain: Domain, rng: random.Random) -> dict[str, Any]:
    if kind == "json_keys":
        keys = sorted(rng.sample(domain.json_keys, rng.randint(2, 3)), key=domain.json_keys.index)
        return {"kind": kind, "keys": keys, "exact": rng.random() < 0.5}
    params: dict[str, Any] = {
        "include": lambda: {"terms": rng.sample(list(domain.by_term), rng.randint(1, 3))},
        "starts_with": lambda: {"text": rng.choice(domain.openers)},
        "ends_with": lambda: {"text": rng.choice(domain.closers)},
        "bullet_count": lambda: {"count": rng.randint(2, 4)},
        "max_words": lambda: {"limit": rng.choice(WORD_LIMITS)},
        "exclude": lambda: {"terms": rng.sample(domain.forbidden, rng.randint(1, 2))},
        "no_exclamation": dict,
    }
    return {"kind": kind, **params[kind]()}


def draw_task(
    rng: random.Random, domains: tuple[str, ...], templates: tuple[str, ...], checks: range
) -> dict[str, Any]:
    """One task's data: domain, template, subject and `len(checks)` check specs."""
    name, template = rng.choice(domains), rng.choice(templates)
    domain = DOMAINS[name]
    shaping, others = TEMPLATES[template]
    n = rng.choice(checks)
    while True:  # restrictions at most half of the checks (a few redraws at worst)
        kinds = [shaping, *rng.sample(others, n - 1)]
        if 2 * sum(kind in RESTRICTIONS for kind in kinds) <= n:
            break
    return {
        "domain": name,
        "template": template,
        "subject": rng.choice(domain.subjects),
        "checks": [_draw_check(kind, domain, rng) for kind in kinds],
    }


def split_of(data: dict[str, Any]) -> str:
    """The split a task's content belongs to: eval for 1 in 8 (by hash), else train."""
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).digest()
    return "eval" if digest[0] < 32 else "train"


def user_prompt(data: dict[str, Any]) -> str:
    domain = DOMAINS[data["domain"]]
    rules = [f"{i}. {RULES[spec['kind']](spec)}" for i, spec in enumerate(data["checks"], 1)]
    return "\n".join([domain.job.format(subject=data["subject"]), "Rules:", *rules])


# ------------------------------------------------------------------------ expert answer


def _spec(data: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((s for s in data["checks"] if s["kind"] == kind), None)


def _slots(sentences: list[str], spare: list[str], n: int) -> list[str]:
    """`sentences` spread over exactly `n` slots: extras join the last, spare ones fill."""
    filled = sentences + spare[: max(0, n - len(sentences))]
    return [*filled[: n - 1], " ".join(filled[n - 1 :])]


def expert_answer(data: dict[str, Any]) -> str:
    """A text that passes every check of a task drawn by `draw_task`."""
    domain = DOMAINS[data["domain"]]
    include = _spec(data, "include")
    terms = include["terms"] if include else []
    sentences = [domain.intro.format(subject=data["subject"])]
    by_term = domain.by_term
    sentences += [by_term.get(t, f"It is about {t}.") for t in terms]
    spare = [s for t, s in by_term.items() if t not in terms]
    if (keys := _spec(data, "json_keys")) is not None:
        values = _slots(sentences, spare, len(keys["keys"]))
        return json.dumps(dict(zip(keys["keys"], values)), ensure_ascii=False)
    if (bullets := _spec(data, "bullet_count")) is not None:
        return "\n".join(f"- {s}" for s in _slots(sentences, spare, bullets["count"]))
    opener, closer = _spec(data, "starts_with"), _spec(data, "ends_with")
    lines = [f"{opener['text']},"] if opener else []
    lines.append(" ".join(sentences))
    return "\n".join(lines + ([closer["text"]] if closer else []))


# ---------------------------------------------------------------------------- the env


def _names(arg: str, value: Any, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """None -> all of `allowed`; else a non-empty list (or comma-separated string) of them."""
    if value is None:
        return allowed
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names or not set(names) <= set(allowed):
        raise EnvError(f"{arg}={value!r} is invalid: expected a list of {', '.join(allowed)}")
    return tuple(dict.fromkeys(names))


def _int(arg: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise EnvError(f"{arg}={value!r} is invalid: expected an integer {low}..{high}")
    return value


class InstructionsEnv:
    """One answer per episode, scored by the fraction of the task's rules it satisfies."""

    name: ClassVar[str] = "instructions"
    description: ClassVar[str] = (
        "Write a short business text obeying 2-4 checkable rules (JSON keys, length, terms, style)."
    )
    outcomes: ClassVar[tuple[str, ...]] = ("all_passed", "partial", "none_passed", "empty")
    solved_outcomes: ClassVar[tuple[str, ...]] = ("all_passed",)
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    default_prompt: ClassVar[str] = (
        "You write short business texts. Follow every rule in the request exactly. "
        "Reply with the text only."
    )

    def __init__(
        self,
        eval_size: int = 128,
        domains: list[str] | str | None = None,
        templates: list[str] | str | None = None,
        min_checks: int = 2,
        max_checks: int = 4,
        system_prompt: str | None = None,
    ) -> None:
        self.eval_size = _int("eval_size", eval_size, 1, 1024)
        self.domains = _names("domains", domains, tuple(DOMAINS))
        self.templates = _names("templates", templates, tuple(TEMPLATES))
        self.max_checks = _int("max_checks", max_checks, 2, MAX_CHECKS)
        self.min_checks = _int("min_checks", min_checks, 2, self.max_checks)
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise EnvError(f"system_prompt={system_prompt!r} is invalid: expected a string")
        self.system_prompt = system_prompt or self.default_prompt
        self.max_turns = 1
        self._eval: list[Task] | None = None
        self._checks: list[dict[str, Any]] | None = None  # the episode's; None between them

    def _draw(self, rng: random.Random, split: str) -> dict[str, Any]:
        """Draw tasks until one belongs to `split` (8 draws on average for eval)."""
        checks = range(self.min_checks, self.max_checks + 1)
        for _ in range(10_000):
            if split_of(data := draw_task(rng, self.domains, self.templates, checks)) == split:
                return data
        raise EnvError(f"{self.name}: no {split} task found; allow more domains or templates")

    def _eval_pool(self) -> list[Task]:
        """The first `eval_size` distinct eval-split contents of the draw sequence."""
        if self._eval is None:
            pool: dict[str, Task] = {}
            for index in range(20 * self.eval_size):  # duplicates are rare: ample
                data = self._draw(random.Random(f"eval-{index}"), "eval")
                task = Task(id=f"instructions-eval-{index}", data=data)
                pool.setdefault(json.dumps(data, sort_keys=True), task)
                if len(pool) == self.eval_size:
                    self._eval = list(pool.values())
                    return self._eval
            raise EnvError(
                f"eval_size={self.eval_size} is invalid: these domains, templates and checks "
                f"give only {len(pool)} distinct eval tasks"
            )
        return self._eval

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list[Task]:
        """Eval: a fixed set of `eval_size` tasks. Train: an unbounded stream, so `n` is
        required; task k of the stream is drawn from its own seeded RNG."""
        if split not in ("train", "eval"):
            raise EnvError(f"{self.name}: split={split!r} is invalid: expected train or eval")
        if n is not None:
            _int("n", n, 0, 2**31)
        if split == "eval":
            pool = self._eval_pool()
            if n is None:
                return list(pool)
            rng = random.Random(seed)  # cycle through fresh shuffles when n > eval_size
            return [
                task
                for start in range(0, n, len(pool))
                for task in rng.sample(pool, min(len(pool), n - start))
            ]
        if n is None:
            raise EnvError(f"{self.name}: the train split is unbounded; pass n")
        return [
            Task(
                id=f"instructions-train-{k}", data=self._draw(random.Random(f"train-{k}"), "train")
            )
            for k in random.Random(seed).sample(range(2**31), n)
        ]

    def reset(self, task: Task) -> Observation:
        data = task.data
        if data.get("domain") not in DOMAINS or not isinstance(data.get("subject"), str):
            raise EnvError(f"task {task.id!r}: needs a known domain and a subject, got {data!r}")
        checks = data.get("checks")
        if not isinstance(checks, list) or not checks:
            raise EnvError(f"task {task.id!r}: 'checks' must be a non-empty list")
        for spec in checks:
            check_spec(spec)
        self._checks = checks
        messages = [Message("system", self.system_prompt), Message("user", user_prompt(data))]
        return Observation(messages, tools=[], tool_choice="none")

    def step(self, message: Message) -> StepResult:
        checks, self._checks = in_progress(self.name, self._checks), None
        # Text the chat layer took for a broken tool call (e.g. JSON with a "name" key) is
        # still the answer: score it.
        answer = message.content if isinstance(message.content, str) else ""
        results = [CHECKS[spec["kind"]](answer, spec) for spec in checks]
        info: dict[str, Any] = {
            "checks": [{"kind": s["kind"], "passed": ok} for s, ok in zip(checks, results)],
            "words": count_words(answer),
            "parse_failure": message.parse_failure,
        }
        if not answer.strip():
            return StepResult([], done=True, reward=0.0, outcome="empty", info=info)
        passed = sum(results)
        outcome = (
            "all_passed" if passed == len(results) else "none_passed" if passed == 0 else "partial"
        )
        return StepResult([], True, reward=passed / len(results), outcome=outcome, info=info)

    def demonstrations(self, task: Task) -> list[Message]:
        """One expert answer that satisfies every check."""
        return [Message("assistant", expert_answer(task.data))]


ENVIRONMENTS: dict[str, type] = {"instructions": InstructionsEnv}
