"""Structured extraction: documents, splits, grading, schema violations, and the chat and
grammar layers taking the environment's schemas as they are."""

from __future__ import annotations

import re
from collections import Counter
from datetime import date

import jsonschema
import pytest

from looprl.chat.formats import FORMATS, format_tool_call
from looprl.chat.parsers import parse_tool_calls, validate_arguments
from looprl.engine import ToolConstraint
from looprl.engine.grammar import GrammarCache
from looprl.envs.base import Environment, demonstrations
from looprl.envs.builtin.extraction import (
    ENVIRONMENTS,
    FIELDS,
    RECORD_TOOLS,
    TOOL_NAME,
    Extraction,
    grade,
)
from looprl.envs.builtin.extraction_docs import KINDS, LAYOUTS, MAX_WORDS, MIN_WORDS, make_document
from looprl.errors import EnvError
from looprl.types import PARSE_FAILURES, Message, Task, ToolCall

ENV = Extraction()
EVAL = ENV.tasks("eval")
TRAIN = ENV.tasks("train", n=1500, seed=0)
TRUTH = {
    "invoice": {
        "due_date": "2026-03-05",
        "invoice_number": "INV-20417",
        "total": 1242.0,
        "vendor": "Cedar Labs",
    },
    "contact": {
        "company": "Maple Media",
        "email": "dana.okafor@maplemedia.io",
        "name": "Dana Okafor",
        "phone": "+44 207 946 0321",
    },
    "event": {"city": "Oslo", "date": "2026-11-20", "start_time": "19:30", "title": "Jazz Night"},
}
MONTHS = [date(2000, m, 1).strftime("%B") for m in range(1, 13)]
FORMS_SEEN = [  # printed forms that the documents must use somewhere
    r"\d{4}-\d{2}-\d{2}",  # ISO date
    r"[A-Z][a-z]+ \d{1,2}, \d{4}",  # March 5, 2026
    r"\d{1,2} [A-Z][a-z]+ \d{4}",  # 5 March 2026
    r"\d{2}/\d{2}/\d{4}",  # 15/03/2026
    r"\d{1,2}:\d{2} [AP]M",  # 7:30 PM
    r"\b[01]\d:\d{2}\b",  # 19:30
    r"\$\d",  # $1,242.00
    r"\d EUR",  # 1,242.00 EUR
    r"\+\d+ \(\d+\)",  # +44 (207) 946 0321
    r"\+\d+-\d+",  # +44-207-946-0321
]


def _call(arguments: object, name: str = TOOL_NAME) -> Message:
    return Message("assistant", tool_calls=[ToolCall(name, arguments, "c1")])


def _play(env: Extraction, task: Task, message: Message):
    env.reset(task)
    return env.step(message)


# ------------------------------------------------------------------- protocol and schemas


def test_protocol_and_registry() -> None:
    assert list(ENVIRONMENTS) == ["extraction"] and ENVIRONMENTS["extraction"] is Extraction
    assert isinstance(ENV, Environment) and ENV.description
    assert ENV.max_turns == 1 and ENV.reward_range == (-1.0, 1.0)
    assert ENV.outcomes == ("exact", "partial", "wrong", *PARSE_FAILURES)


@pytest.mark.parametrize("kind", KINDS)
def test_tool_schema(kind: str) -> None:
    fn = RECORD_TOOLS[kind]["function"]
    params = fn["parameters"]
    jsonschema.Draft202012Validator.check_schema(params)
    assert fn["name"] == TOOL_NAME and 3 <= len(params["properties"]) <= 5
    assert params["required"] == list(FIELDS[kind]) == sorted(FIELDS[kind])
    assert params["additionalProperties"] is False and set(TRUTH[kind]) == set(FIELDS[kind])
    assert all(p.get("description") for p in params["properties"].values())
    assert validate_arguments(ToolCall(TOOL_NAME, TRUTH[kind]), [RECORD_TOOLS[kind]]) is None


def test_the_chat_layer_rejects_what_breaks_the_schema() -> None:
    tools = [RECORD_TOOLS["invoice"]]
    for change in (
        {"due_date": "March 5, 2026"},
        {"due_date": "2026-3-5"},
        {"total": "1242.00"},
        {"total": True},
        {"vendor": None},
        {"note": "extra"},
    ):
        call = ToolCall(TOOL_NAME, {**TRUTH["invoice"], **change})
        assert validate_arguments(call, tools) is not None, change
    tools = [RECORD_TOOLS["event"]]
    for bad in ("7:30", "24:00", "19:30 PM", "1930"):
        call = ToolCall(TOOL_NAME, {**TRUTH["event"], "start_time": bad})
        assert validate_arguments(call, tools) is not None, bad


def test_observation_has_the_kind_schema_only() -> None:
    for task in EVAL[:6]:
        obs = ENV.reset(task)
        assert obs.tools == [RECORD_TOOLS[task.data["kind"]]] and obs.tool_choice == "required"
        assert [m.role for m in obs.messages] == ["system", "user"]
        assert task.data["document"] in obs.messages[1].content
        assert task.data["kind"] in obs.messages[1].content
    env = Extraction(tool_choice="auto", system_prompt="Be brief.")
    obs = env.reset(EVAL[0])
    assert obs.tool_choice == "auto" and obs.messages[0].content == "Be brief."


# ------------------------------------------------------------------------------ documents


def _date_forms(iso: str) -> set[str]:
    day = date.fromisoformat(iso)
    month = MONTHS[day.month - 1]
    return {
        iso,
        f"{month} {day.day}, {day.year}",
        f"{day.day} {month} {day.year}",
        f"{month[:3]} {day.day}, {day.year}",
        f"{day.day:02d}/{day.month:02d}/{day.year}",
    }


def _time_forms(hhmm: str) -> set[str]:
    hour, minute = map(int, hhmm.split(":"))
    h12, half = (hour - 1) % 12 + 1, "AM" if hour < 12 else "PM"
    forms = {hhmm, f"{h12}:{minute:02d} {half}", f"{h12}.{minute:02d}{half}"}
    return forms | ({f"{h12} {half}"} if minute == 0 else set())


def _digits(text: str) -> str:
    return re.sub(r"\D", "", text)


def _answer_is_in(doc: str, kind: str, record: dict) -> None:
    """Each answer can be read off the document (in one of its printed forms)."""
    text_fields = {"invoice": ("invoice_number", "vendor"), "contact": ("name", "email", "company")}
    for key in text_fields.get(kind, ("title", "city")):
        assert record[key].casefold() in doc.casefold(), key
    if kind == "invoice":
        assert f"{record['total']:,.2f}" in doc
        assert any(form in doc for form in _date_forms(record["due_date"]))
    elif kind == "contact":
        phones = re.findall(r"\+\d[\d ().-]{8,}\d", doc)
        assert _digits(record["phone"]) in {_digits(p) for p in phones}
    else:
        assert any(form in doc for form in _date_forms(record["date"]))
        assert any(form in doc for form in _time_forms(record["start_time"]))


def _distractors(doc: str, kind: str) -> None:
    """A look-alike of each kind of answer stands beside it."""
    dates = re.findall(r"\d{4}-\d{2}-\d{2}|\d{2}/\d{2}/\d{4}|[A-Z][a-z]+,? \d{1,2},? \d{4}", doc)
    dates += re.findall(r"\d{1,2} [A-Z][a-z]+ \d{4}", doc)
    if kind == "invoice":
        assert len(re.findall(r"\d+\.\d{2}\b", doc)) >= 3  # subtotal, tax, total
        assert len(dates) >= 2  # issue and due date
    elif kind == "contact":
        assert len(set(re.findall(r"[\w.]+@[\w.]+\w", doc))) == 2
        assert len(re.findall(r"\+\d[\d ().-]{8,}\d", doc)) == 2
    else:
        assert len(dates) >= 2
        assert len(re.findall(r"\b\d{1,2}(?::\d{2}|\.\d{2}[AP]M| [AP]M)", doc)) >= 2  # doors, start


def test_documents_are_sized_readable_and_carry_distractors() -> None:
    for task in EVAL + TRAIN:
        doc, kind, record = task.data["document"], task.data["kind"], task.data["record"]
        assert MIN_WORDS <= len(doc.split()) <= MAX_WORDS, (task.id, len(doc.split()))
        assert list(record) != [] and set(record) == set(FIELDS[kind])
        assert validate_arguments(ToolCall(TOOL_NAME, record), [RECORD_TOOLS[kind]]) is None
        _answer_is_in(doc, kind, record)
        _distractors(doc, kind)


def test_format_variety() -> None:
    tasks = EVAL + TRAIN
    seen = Counter((t.data["kind"], t.data["layout"]) for t in tasks)
    assert set(seen) == {(k, layout) for k in KINDS for layout in LAYOUTS}
    docs = " ".join(t.data["document"] for t in tasks)
    for pattern in FORMS_SEEN:
        assert re.search(pattern, docs), pattern
    # Numeric dates are DD/MM/YYYY with a day above 12, so none can be read as MM/DD.
    for day, month in re.findall(r"\b(\d{2})/(\d{2})/\d{4}\b", docs):
        assert int(day) > 12 and 1 <= int(month) <= 12
    assert len({t.data["document"] for t in tasks}) == len(tasks)


def test_make_document_is_deterministic() -> None:
    assert make_document("event", 7) == make_document("event", 7)
    assert make_document("event", 7) != make_document("event", 9)


# ---------------------------------------------------------------------------------- splits


def test_splits_are_deterministic_and_disjoint() -> None:
    assert [t.id for t in EVAL] == [f"{KINDS[i % 3]}-eval-{i}" for i in range(256)]
    assert all(t.seed % 2 == 0 for t in EVAL) and all(t.seed % 2 == 1 for t in TRAIN)
    assert not {t.data["document"] for t in EVAL} & {t.data["document"] for t in TRAIN}
    assert not {t.id for t in EVAL} & {t.id for t in TRAIN}
    assert len({t.id for t in TRAIN}) == len(TRAIN)
    assert Extraction().tasks("eval") == EVAL
    assert Extraction().tasks("train", n=50, seed=0) == TRAIN[:50]
    assert ENV.tasks("train", n=50, seed=1) != TRAIN[:50]
    assert ENV.tasks("eval", n=10, seed=3) == ENV.tasks("eval", n=10, seed=3)
    assert len({t.id for t in ENV.tasks("eval", n=256, seed=3)}) == 256
    assert Counter(t.data["kind"] for t in EVAL) == {"invoice": 86, "contact": 85, "event": 85}
    only = Extraction(kinds=["contact"], eval_size=8)
    assert {t.data["kind"] for t in only.tasks("eval") + only.tasks("train", n=20)} == {"contact"}
    with pytest.raises(EnvError, match="pass n"):
        ENV.tasks("train")
    with pytest.raises(EnvError, match="split"):
        ENV.tasks("test")


def test_a_train_document_equal_to_an_eval_one_is_skipped() -> None:
    env = Extraction()
    env._eval_documents = {TRAIN[0].data["document"]}  # as if eval held the same text
    assert env.tasks("train", n=2, seed=0) == TRAIN[1:3]


# ---------------------------------------------------------------------------------- grading


@pytest.mark.parametrize(
    ("kind", "change", "reward", "outcome"),
    [
        ("invoice", {}, 1.0, "exact"),
        ("invoice", {"vendor": "  cedar   LABS "}, 1.0, "exact"),  # case and whitespace
        ("invoice", {"total": 1242}, 1.0, "exact"),  # an int is the same number
        ("invoice", {"total": 1242.004}, 1.0, "exact"),  # equal to the cent
        ("invoice", {"total": 1242.01}, 0.75, "partial"),  # 2*3 / (4+4)
        ("invoice", {"total": 1150.0, "vendor": "Harbor Design"}, 0.5, "partial"),
        ("invoice", {"due_date": "2026-03-06"}, 0.75, "partial"),
        ("contact", {"phone": "+44 (207) 946-0321"}, 1.0, "exact"),  # compared by digits
        ("contact", {"phone": "+44 207 946 0322"}, 0.75, "partial"),
        ("contact", {"email": "DANA.OKAFOR@maplemedia.io"}, 1.0, "exact"),
        ("contact", {"name": "", "company": " "}, 4 / 6, "partial"),  # blank: no answer (2C/(S+T))
        ("event", {"title": "Jazz"}, 0.75, "partial"),
        (
            "event",
            {"date": "2025-11-20", "city": "Bergen", "title": "x", "start_time": "18:30"},
            0.0,
            "wrong",
        ),  # fmt: skip
        ("event", {"date": "2026-11-21", "city": "", "title": ""}, 1 / 3, "partial"),
    ],
)
def test_grade(kind: str, change: dict, reward: float, outcome: str) -> None:
    submitted = {**TRUTH[kind], **change}
    got = grade(kind, submitted, TRUTH[kind])
    assert (got.reward, got.outcome) == (pytest.approx(reward), outcome)
    assert got.f1 == pytest.approx(2 * got.precision * got.recall / (got.precision + got.recall)
                                   if got.precision + got.recall else 0.0)  # fmt: skip
    assert got.reward == got.f1 - 0.1 * len(got.violations)


@pytest.mark.parametrize(
    ("change", "drop", "reward", "violations"),
    [
        ({"note": "x"}, (), 8 / 9 - 0.1, {"note"}),  # an extra key: one more wrong field
        ({"total": "1242.00"}, (), 0.75 - 0.1, {"total"}),  # wrong type: counted wrong
        ({"due_date": "5 March 2026"}, (), 0.75 - 0.1, {"due_date"}),  # breaks the pattern
        ({"vendor": None}, (), 0.75 - 0.1, {"vendor"}),
        ({}, ("vendor",), 6 / 7 - 0.1, {"vendor"}),  # missing: a recall miss and a violation
        ({f"k{i}": 1 for i in range(30)} | {"total": 0.0}, (), -1.0, None),  # floored at -1
    ],
)
def test_schema_violations_cost_a_penalty(change, drop, reward, violations) -> None:
    submitted = {k: v for k, v in {**TRUTH["invoice"], **change}.items() if k not in drop}
    got = grade("invoice", submitted, TRUTH["invoice"])
    assert got.reward == pytest.approx(reward) and got.outcome in ("partial", "wrong")
    assert violations is None or set(got.violations) == violations


def test_violations_everywhere_score_wrong_below_zero() -> None:
    got = grade("event", {"date": 20261120, "start_time": "7pm", "where": "Oslo"}, TRUTH["event"])
    assert got.outcome == "wrong" and set(got.violations) == {
        "date", "start_time", "where", "city", "title"}  # fmt: skip
    assert got.reward == pytest.approx(0.0 - 0.5) and got.correct == dict.fromkeys(
        FIELDS["event"], False
    )  # noqa: E501


# -------------------------------------------------------------------------------- episodes


def test_demonstrations_are_exact() -> None:
    for task in EVAL + TRAIN[:300]:
        (msg,) = demonstrations(ENV, task)
        assert list(msg.tool_calls[0].arguments) == list(FIELDS[task.data["kind"]])
        res = _play(ENV, task, msg)
        assert (res.done, res.reward, res.outcome, res.messages) == (True, 1.0, "exact", [])
        assert res.info["f1"] == 1.0 and all(res.info["correct"].values())


def test_step_outcomes_and_info() -> None:
    task = next(t for t in EVAL if t.data["kind"] == "invoice")
    truth = task.data["record"]
    res = _play(ENV, task, _call({**truth, "total": truth["total"] + 1}))
    assert (res.outcome, res.reward) == ("partial", 0.75)
    assert res.info["correct"] == {k: k != "total" for k in FIELDS["invoice"]}
    assert res.info["kind"] == "invoice" and res.info["truth"] == truth
    assert (res.info["precision"], res.info["recall"], res.info["violations"]) == (0.75, 0.75, {})
    for failure in PARSE_FAILURES:
        res = _play(ENV, task, Message("assistant", parse_failure=failure))
        assert (res.done, res.outcome, res.reward, res.info["f1"]) == (True, failure, -1.0, 0.0)
    for message, outcome in (
        (Message("assistant", "no call"), "no_tool_call"),
        (_call(truth, name="choose_square"), "unknown_tool"),
        (_call(["not", "a", "dict"]), "bad_arguments"),
    ):
        assert _play(ENV, task, message).outcome == outcome
    two = Message("assistant", tool_calls=[_call(truth).tool_calls[0], _call({}).tool_calls[0]])
    assert _play(ENV, task, two).outcome == "exact"  # the first call counts
    with pytest.raises(EnvError, match="step"):
        ENV.step(_call(truth))  # the episode is over
    with pytest.raises(EnvError, match="parse_failure"):
        _play(ENV, task, Message("assistant", parse_failure="gibberish"))


@pytest.mark.parametrize(
    "data",
    [
        {"kind": "receipt", "document": "x", "record": {}},
        {"kind": "event", "record": TRUTH["event"]},
        {"kind": "event", "document": "x", "record": TRUTH["contact"]},
    ],
)
def test_reset_rejects_broken_tasks(data: dict) -> None:
    with pytest.raises(EnvError, match="task 't'"):
        Extraction().reset(Task("t", data))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"kinds": []}, "kinds=\\[\\]"),
        ({"kinds": "invoice"}, "kinds='invoice'"),
        ({"kinds": ["invoice", "receipt"]}, "kinds='receipt'.*invoice, contact, event"),
        ({"kinds": ["event", "event"]}, "listed twice"),
        ({"tool_choice": "sometimes"}, "tool_choice='sometimes'"),
        ({"eval_size": 0}, "eval_size=0"),
        ({"system_prompt": 3}, "system_prompt=3"),
    ],
)
def test_constructor_validation(kwargs: dict, needle: str) -> None:
    with pytest.raises(EnvError, match=needle):
        Extraction(**kwargs)


# ------------------------------------------------------------------ chat and grammar layers


@pytest.mark.parametrize("fmt", FORMATS)
def test_demonstrations_survive_every_call_syntax(fmt: str) -> None:
    """Rendered in the model's syntax and parsed back (glm's text values get their JSON
    types back from the schema), the demonstration still scores exact."""
    for task in EVAL[:9]:
        (msg,) = demonstrations(ENV, task)
        tools = [RECORD_TOOLS[task.data["kind"]]]
        parsed = parse_tool_calls(format_tool_call(msg.tool_calls[0], fmt), tools, fmt)
        assert parsed.failure is None, parsed.detail
        assert _play(ENV, task, Message("assistant", tool_calls=parsed.calls)).outcome == "exact"


def test_forced_call_grammar_takes_the_demonstration_and_refuses_a_bad_date(tokenizer) -> None:
    cache = GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    for task in EVAL[:3]:
        constraint = ToolConstraint([RECORD_TOOLS[task.data["kind"]]], "required", "hermes")
        (msg,) = demonstrations(ENV, task)
        call = msg.tool_calls[0]
        matcher = cache.matcher(constraint)
        assert matcher.accept_string(format_tool_call(call, "hermes"))
        assert matcher.is_completed()
        date_key = "due_date" if "due_date" in call.arguments else "date"
        if date_key in call.arguments:
            bad = ToolCall(TOOL_NAME, {**call.arguments, date_key: "March 5, 2026"})
            assert not cache.matcher(constraint).accept_string(format_tool_call(bad, "hermes"))
