"""Instruction following: each check's rule, task generation, scoring and the expert."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from looprl.chat.parsers import parse_tool_calls
from looprl.envs.base import Environment, demonstrations
from looprl.envs.builtin.instructions import (
    CHECKS,
    DOMAINS,
    ENVIRONMENTS,
    RESTRICTIONS,
    TEMPLATES,
    InstructionsEnv,
    count_words,
    expert_answer,
    json_object,
    split_of,
)
from looprl.errors import EnvError
from looprl.loop.sft import demo_episode
from looprl.types import Message, Task


def _key(task: Task) -> str:
    return json.dumps(task.data, sort_keys=True)


def _answer(text: str, **kwargs: object) -> Message:
    return Message("assistant", text, **kwargs)


# ------------------------------------------------------------------------- check rules


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", 0),
        ("   \n", 0),
        ("Hello, world.", 2),
        ("don't re-use the e-mail", 4),  # inner apostrophes and hyphens join
        ("- one\n- two", 2),  # bullet dashes are not words
        ('{"next_step": "Call us"}', 3),  # keys count, quotes and braces do not
        ("Café naïve 東京 ok", 4),  # unicode letters
        ("well -- then ... 3.5 !!", 4),  # "3.5" is two runs of digits
        ("🙂 🙂", 0),
    ],
)
def test_count_words(text: str, words: int) -> None:
    assert count_words(text) == words


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ('{"a": 1}', {"a": 1}),
        ('  {"a": 1}\n', {"a": 1}),
        ('Here it is:\n```json\n{"a": 1, "b": [2]}\n```\nDone.', {"a": 1, "b": [2]}),
        ('```JSON\n{"a": 1}```', {"a": 1}),
        ('```\n{"a": 1}\n```', {"a": 1}),
        ('Here: {"a": 1}', None),  # prose around an unfenced object
        ("[1, 2]", None),  # not an object
        ('{"a": 1', None),
        ("", None),
        ("[" * 100_000, None),  # too deep: no RecursionError escapes
    ],
)
def test_json_object(text: str, found: dict | None) -> None:
    assert json_object(text) == found


CASES = [
    # json_keys
    ("json_keys", {"keys": ["a", "b"], "exact": True}, '{"a": 1, "b": 2}', True),
    ("json_keys", {"keys": ["a", "b"], "exact": True}, '{"b": 2, "a": 1, "c": 3}', False),
    ("json_keys", {"keys": ["a", "b"], "exact": False}, '{"b": 2, "a": 1, "c": 3}', True),
    ("json_keys", {"keys": ["a", "b"], "exact": False}, '{"a": 1}', False),
    ("json_keys", {"keys": ["a"], "exact": True}, '```json\n{"a": "x"}\n```', True),
    ("json_keys", {"keys": ["a"], "exact": True}, '{"A": 1}', False),  # keys are exact
    ("json_keys", {"keys": ["a"], "exact": False}, "a: 1", False),
    # include: whole words, ignoring case
    ("include", {"terms": ["refund", "order"]}, "Your ORDER and Refund.", True),
    ("include", {"terms": ["refund", "order"]}, "Your order, refunds soon", False),
    ("include", {"terms": ["order"]}, "reorder", False),
    ("include", {"terms": ["café"]}, "Le CAFÉ est ouvert", True),
    ("include", {"terms": ["next_step"]}, '{"next_step": 1}', True),
    ("include", {"terms": ["order"]}, "", False),
    # exclude
    ("exclude", {"terms": ["sorry"]}, "We are SORRY.", False),
    ("exclude", {"terms": ["sorry"]}, "Sorrywise, no.", True),
    ("exclude", {"terms": ["sorry", "cannot"]}, "We can not.", True),
    ("exclude", {"terms": ["sorry"]}, "", True),
    # max_words
    ("max_words", {"limit": 3}, "one two three", True),
    ("max_words", {"limit": 3}, "one two three four", False),
    ("max_words", {"limit": 0}, "", True),
    # no_exclamation
    ("no_exclamation", {}, "Calm. Quiet?", True),
    ("no_exclamation", {}, "Great!", False),
    # starts_with
    ("starts_with", {"text": "Hello"}, "  hello, Ana", True),
    ("starts_with", {"text": "Hello"}, "Helloo", False),
    ("starts_with", {"text": "Hello"}, "Oh. Hello", False),
    ("starts_with", {"text": "Hi there"}, "Hi there!", True),
    ("starts_with", {"text": "Hello"}, "", False),
    # ends_with
    ("ends_with", {"text": "Best regards"}, "Text.\nBest regards,\n", True),
    ("ends_with", {"text": "Best regards"}, "Text. best REGARDS!", True),
    ("ends_with", {"text": "Best regards"}, "Best regards, Ana", False),
    ("ends_with", {"text": "Thank you"}, "Text. Thank youu", False),
    ("ends_with", {"text": "Thank you"}, "Ok. Thank you", True),
    ("ends_with", {"text": "Thank you"}, "Ok.Thank you", True),
    ("ends_with", {"text": "you"}, "Thank-you", True),  # a hyphen is a boundary
    ("ends_with", {"text": "Thank you"}, "", False),
    # bullet_count
    ("bullet_count", {"count": 2}, "Intro\n- one\n  - two\nend", True),
    ("bullet_count", {"count": 2}, "- one\n- two\n- three", False),
    ("bullet_count", {"count": 2}, "- one\n-two\n* three\n- ", False),  # only "- text" counts
    ("bullet_count", {"count": 2}, "- one\r\n- two", True),
    ("bullet_count", {"count": 0}, "", True),
]


@pytest.mark.parametrize(("kind", "spec", "answer", "passed"), CASES)
def test_check_rules(kind: str, spec: dict, answer: str, passed: bool) -> None:
    assert CHECKS[kind](answer, {"kind": kind, **spec}) is passed


def test_every_check_kind_has_cases_and_a_rule() -> None:
    assert {case[0] for case in CASES} == set(CHECKS)
    assert set(CHECKS) > RESTRICTIONS and len(CHECKS) == 8
    for fn in CHECKS.values():
        assert fn.__doc__  # the rule is written down


# -------------------------------------------------------------------------- the tasks


def test_registry_and_protocol() -> None:
    assert len(ENVIRONMENTS) == 1 and ENVIRONMENTS["instructions"] is InstructionsEnv
    env = InstructionsEnv()
    assert isinstance(env, Environment)
    assert env.name == "instructions" and "\n" not in env.description
    assert env.max_turns == 1 and env.reward_range == (0.0, 1.0)


def test_tasks_deterministic_and_splits_disjoint() -> None:
    env = InstructionsEnv()
    ev, tr = env.tasks("eval"), env.tasks("train", n=3000, seed=0)
    assert len(ev) == 128 and len({t.id for t in ev}) == 128
    assert len({_key(t) for t in ev}) == 128  # distinct contents
    assert len({t.id for t in tr}) == 3000
    assert ev == InstructionsEnv().tasks("eval")
    assert tr == InstructionsEnv().tasks("train", n=3000, seed=0)
    assert env.tasks("train", n=20, seed=1) != env.tasks("train", n=20, seed=2)
    assert not {_key(t) for t in ev} & {_key(t) for t in tr}
    assert not {t.id for t in ev} & {t.id for t in tr}
    assert {split_of(t.data) for t in ev} == {"eval"}
    assert {split_of(t.data) for t in tr} == {"train"}
    for task in ev + tr[:200]:
        assert json.loads(json.dumps(task.data)) == task.data
    # A smaller eval set is a prefix of the default one.
    assert InstructionsEnv(eval_size=10).tasks("eval") == ev[:10]


def test_eval_sampling() -> None:
    env = InstructionsEnv(eval_size=5)
    pool = {t.id for t in env.tasks("eval")}
    some = env.tasks("eval", n=3, seed=4)
    assert len(some) == 3 and {t.id for t in some} <= pool
    assert some == env.tasks("eval", n=3, seed=4)
    counts = Counter(t.id for t in env.tasks("eval", n=12, seed=1))
    assert set(counts) == pool and sorted(counts.values()) == [2, 2, 2, 3, 3]  # cycles evenly
    assert env.tasks("eval", n=0) == [] and env.tasks("train", n=0) == []


def test_bad_task_requests() -> None:
    env = InstructionsEnv()
    with pytest.raises(EnvError, match="split='test'"):
        env.tasks("test")
    with pytest.raises(EnvError, match="pass n"):
        env.tasks("train")
    with pytest.raises(EnvError, match="n=-1"):
        env.tasks("train", n=-1)


def test_task_variety() -> None:
    env = InstructionsEnv()
    tasks = env.tasks("eval") + env.tasks("train", n=500)
    kinds = Counter(spec["kind"] for t in tasks for spec in t.data["checks"])
    assert set(kinds) == set(CHECKS)
    assert {t.data["domain"] for t in tasks} == set(DOMAINS)
    assert {t.data["template"] for t in tasks} == set(TEMPLATES)
    assert {len(t.data["checks"]) for t in tasks} == {2, 3, 4}
    for task in tasks:
        checks = [spec["kind"] for spec in task.data["checks"]]
        assert checks[0] == TEMPLATES[task.data["template"]][0]  # the shaping check first
        assert len(set(checks)) == len(checks)
        assert 2 * sum(kind in RESTRICTIONS for kind in checks) <= len(checks)
    narrow = InstructionsEnv(domains=["meeting"], templates="json", min_checks=3, max_checks=3)
    for task in narrow.tasks("eval") + narrow.tasks("train", n=50):
        assert (task.data["domain"], task.data["template"]) == ("meeting", "json")
        assert len(task.data["checks"]) == 3


def test_prompts_are_short_and_state_every_rule(tokenizer) -> None:
    env = InstructionsEnv()
    for task in env.tasks("eval"):
        obs = env.reset(task)
        assert obs.tools == [] and obs.tool_choice == "none"
        system, user = obs.messages
        assert (system.role, user.role) == ("system", "user")
        assert len(tokenizer(system.content + "\n" + user.content).input_ids) < 200
        for spec in task.data["checks"]:
            for word in spec.get("terms", []) + spec.get("keys", []) + [spec.get("text", "")]:
                assert word in user.content
            for number in ("count", "limit"):
                if number in spec:
                    assert str(spec[number]) in user.content
    task = Task("t", {"domain": "support", "subject": "a late delivery", "checks": [
        {"kind": "json_keys", "keys": ["answer", "ticket"], "exact": True},
        {"kind": "no_exclamation"},
    ]})  # fmt: skip
    assert env.reset(task).messages[1].content == (
        "Write a reply to a customer about a late delivery.\nRules:\n"
        '1. Answer with a JSON object with exactly the keys "answer", "ticket".\n'
        "2. Do not use exclamation marks."
    )


# -------------------------------------------------------------------- expert and words


def test_domain_word_lists() -> None:
    for domain in DOMAINS.values():
        texts = [domain.intro.format(subject=s) for s in domain.subjects]
        texts += [*domain.by_term.values(), *domain.openers, *domain.closers, *domain.json_keys]
        for text in texts:
            assert CHECKS["exclude"](text, {"terms": list(domain.forbidden)}), text
            assert "!" not in text
        for term, sentence in domain.by_term.items():
            assert term == term.lower() and CHECKS["include"](sentence, {"terms": [term]})
        assert len(domain.by_term) == len(domain.sentences)


def test_expert_reaches_max_reward() -> None:
    env = InstructionsEnv()
    for task in env.tasks("eval") + env.tasks("train", n=1000, seed=7):
        (demo,) = demonstrations(env, task)
        assert demo.role == "assistant" and not demo.tool_calls
        assert count_words(demo.content) <= 40
        env.reset(task)
        result = env.step(demo)
        assert (result.done, result.reward, result.outcome) == (True, 1.0, "all_passed")
        assert all(c["passed"] for c in result.info["checks"])


def test_demo_episode_for_sft(renderer) -> None:
    env = InstructionsEnv()
    for task in env.tasks("eval", n=6):
        episode = demo_episode(env, task, renderer)
        assert (episode.reward, episode.outcome) == (1.0, "all_passed")
        assert 0 < episode.response_len < 128  # fits the default generation budget


def test_saying_little_earns_at_most_half() -> None:
    env = InstructionsEnv()
    for task in env.tasks("eval"):
        for junk in ("ok", '{"x": 1}', "- fine"):  # obeys no content rule
            env.reset(task)
            assert env.step(_answer(junk)).reward <= 0.5


# ----------------------------------------------------------------------- scoring


SUPPORT = Task("s", {"domain": "support", "subject": "a late delivery", "template": "message",
    "checks": [
        {"kind": "include", "terms": ["refund", "order"]},
        {"kind": "starts_with", "text": "Hello"},
        {"kind": "max_words", "limit": 12},
        {"kind": "exclude", "terms": ["sorry"]},
    ]})  # fmt: skip


@pytest.mark.parametrize(
    ("answer", "reward", "outcome", "passed"),
    [
        ("Hello, your order ships today with a refund.", 1.0, "all_passed", [1, 1, 1, 1]),
        ("hello, your Order and REFUND. Best regards", 1.0, "all_passed", [1, 1, 1, 1]),
        ("Hello, we are sorry about the order.", 0.5, "partial", [0, 1, 1, 0]),
        ("Hi. Your order: refund.", 0.75, "partial", [1, 0, 1, 1]),
        ("Sorry " * 13, 0.0, "none_passed", [0, 0, 0, 0]),
        ("", 0.0, "empty", [0, 0, 1, 1]),
        (" \n\t ", 0.0, "empty", [0, 0, 1, 1]),
    ],
)
def test_rewards_and_outcomes(answer: str, reward: float, outcome: str, passed: list) -> None:
    env = InstructionsEnv()
    obs = env.reset(SUPPORT)
    assert obs.messages[1].content.startswith("Write a reply to a customer about a late delivery.")
    result = env.step(_answer(answer))
    assert (result.done, result.messages) == (True, [])
    assert (result.reward, result.outcome) == (reward, outcome)
    assert [c["passed"] for c in result.info["checks"]] == [bool(p) for p in passed]
    assert [c["kind"] for c in result.info["checks"]] == [s["kind"] for s in SUPPORT.data["checks"]]
    assert result.info["words"] == count_words(answer)
    assert outcome in env.outcomes
    low, high = env.reward_range
    assert low <= result.reward <= high


def test_every_outcome_reachable_and_declared() -> None:
    env = InstructionsEnv()
    seen = set()
    for answer in ("Hello, your order ships with a refund.", "Hi", "sorry " * 20, ""):
        env.reset(SUPPORT)
        seen.add(env.step(_answer(answer)).outcome)
    assert seen == set(env.outcomes)


def test_parse_failures_are_scored_on_their_text() -> None:
    env = InstructionsEnv()
    env.reset(SUPPORT)
    text = "Hello, your order and refund.\n<tool_call>{oops"
    result = env.step(_answer(text, parse_failure="bad_json", parse_detail="x"))
    assert (result.reward, result.outcome) == (1.0, "all_passed")
    assert result.info["parse_failure"] == "bad_json"
    env.reset(SUPPORT)
    assert env.step(_answer("", parse_failure="unknown_tool")).outcome == "empty"
    # A JSON answer with a "name" key looks like a call of an unknown tool to the parser.
    task = Task("p", {"domain": "product", "subject": "folding bike", "checks": [
        {"kind": "json_keys", "keys": ["name", "tagline"], "exact": True}]})  # fmt: skip
    parsed = parse_tool_calls('{"name": "Bike", "tagline": "Go"}', [], "hermes", False)
    assert parsed.failure == "unknown_tool"
    env.reset(task)
    message = _answer(parsed.content, parse_failure=parsed.failure)
    assert env.step(message).outcome == "all_passed"


def test_step_outside_an_episode() -> None:
    env = InstructionsEnv()
    with pytest.raises(EnvError, match="step"):
        env.step(_answer("Hello"))  # before reset
    env.reset(SUPPORT)
    env.step(_answer("Hello"))
    with pytest.raises(EnvError, match="step"):
        env.step(_answer("Hello"))  # episode already over
    env.reset(SUPPORT)  # a new episode starts cleanly
    assert env.step(_answer("Hello")).done


# ------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"eval_size": 0}, "eval_size=0"),
        ({"eval_size": "many"}, "eval_size='many'"),
        ({"eval_size": True}, "eval_size=True"),
        ({"domains": ["support", "legal"]}, "domains=.*support, product, incident, meeting"),
        ({"domains": []}, "domains=\\[\\]"),
        ({"domains": 3}, "domains=3"),
        ({"templates": "poem"}, "templates='poem'.*message, bullets, json"),
        ({"min_checks": 1}, "min_checks=1.*2..4"),
        ({"max_checks": 5}, "max_checks=5.*2..4"),
        ({"min_checks": 4, "max_checks": 3}, "min_checks=4.*2..3"),
        ({"system_prompt": 7}, "system_prompt=7"),
    ],
)
def test_constructor_validation(kwargs: dict, needle: str) -> None:
    with pytest.raises(EnvError, match=needle):
        InstructionsEnv(**kwargs)


def test_custom_system_prompt_and_comma_lists() -> None:
    env = InstructionsEnv(system_prompt="Be brief.", domains="support,meeting")
    assert env.domains == ("support", "meeting")
    assert env.reset(env.tasks("eval")[0]).messages[0].content == "Be brief."


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"domain": "legal", "subject": "x", "checks": [{"kind": "no_exclamation"}]}, "domain"),
        ({"domain": "support", "subject": "x", "checks": []}, "checks"),
        ({"domain": "support", "subject": "x", "checks": [{"kind": "rhyme"}]}, "kind one of"),
        ({"domain": "support", "subject": "x", "checks": ["include"]}, "kind one of"),
        ({"domain": "support", "subject": "x",
          "checks": [{"kind": "include", "terms": "refund"}]}, "invalid terms"),
        ({"domain": "support", "subject": "x",
          "checks": [{"kind": "max_words", "limit": -1}]}, "invalid limit"),
        ({"domain": "support", "subject": "x",
          "checks": [{"kind": "json_keys", "keys": ["a"]}]}, "invalid exact"),
    ],
)  # fmt: skip
def test_reset_rejects_bad_tasks(data: dict, needle: str) -> None:
    with pytest.raises(EnvError, match=needle):
        InstructionsEnv().reset(Task("bad", data))


def test_expert_answer_shapes() -> None:
    data = {"domain": "incident", "subject": "the login failure", "template": "bullets",
            "checks": [{"kind": "bullet_count", "count": 3},
                       {"kind": "include", "terms": ["fix"]}]}  # fmt: skip
    assert expert_answer(data) == (
        "- This summary covers the login failure.\n- A fix is now live.\n- We found the root cause."
    )
    data["checks"] = [{"kind": "json_keys", "keys": ["title", "cause"], "exact": True},
                      {"kind": "include", "terms": ["fix", "rollback"]}]  # fmt: skip
    assert json.loads(expert_answer(data)) == {
        "title": "This summary covers the login failure.",
        "cause": "A fix is now live. A rollback restored service.",
    }
