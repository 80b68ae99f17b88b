"""Tool-call parsing and rendering: round trips, tolerance, failure classes, robustness."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from looprl.chat.formats import FORMATS, detect_format, format_tool_call, format_tool_calls
from looprl.chat.parsers import ParseResult, parse_tool_calls, validate_arguments
from looprl.types import PARSE_FAILURES, ToolCall


def _fn(name: str, parameters: dict | None) -> dict:
    fn: dict = {"name": name, "description": f"the {name} tool"}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


TOOLS = [
    _fn(
        "choose_square",
        {
            "type": "object",
            "properties": {"square": {"type": "integer", "minimum": 0, "maximum": 8}},
            "required": ["square"],
            "additionalProperties": False,
        },
    ),
    _fn(
        "search",
        {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer", "minimum": 1},
                "mode": {"type": "string", "enum": ["fast", "deep"]},
            },
            "required": ["query"],
        },
    ),
    _fn(
        "configure",
        {
            "type": "object",
            "properties": {
                "enabled": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "limits": {"type": "object", "properties": {"cpu": {"type": "number"}}},
                "note": {"type": ["string", "null"]},
            },
        },
    ),
    _fn("get_board", None),
    # bare (non-OpenAI-wrapped) tool form
    {"name": "echo", "description": "echo", "parameters": {"type": "object"}},
]
TOOL_NAMES = {"choose_square", "search", "configure", "get_board", "echo"}

CALLS = [
    ToolCall("choose_square", {"square": 5}),
    ToolCall("search", {"query": "weather in Zürich", "limit": 3, "mode": "deep"}),
    ToolCall("search", {"query": "42"}),  # digits that must stay a string
    ToolCall(
        "configure",
        {"enabled": True, "tags": ["a", "b"], "limits": {"cpu": 1.5}, "note": "x y"},
    ),
    ToolCall("get_board", {}),
    ToolCall("echo", {"anything": [1, {"nested": None}]}),
]


def _assert_well_formed(result: ParseResult, require_call: bool = True) -> None:
    assert isinstance(result, ParseResult)
    assert isinstance(result.content, str)
    assert result.reasoning is None or isinstance(result.reasoning, str)
    if result.failure is None:
        assert result.detail is None
        if require_call:
            assert result.calls
        for call in result.calls:
            assert call.name in TOOL_NAMES
            assert isinstance(call.arguments, dict)
            assert validate_arguments(call, TOOLS) is None
    else:
        assert result.failure in PARSE_FAILURES
        assert result.calls == []
        assert isinstance(result.detail, str) and len(result.detail) <= 200
        if not require_call:
            assert result.failure != "no_tool_call"


# --- round trips and exact rendering -------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.name)
def test_round_trip(fmt: str, call: ToolCall) -> None:
    result = parse_tool_calls(format_tool_call(call, fmt), TOOLS, fmt)
    assert result.failure is None, result.detail
    assert result.calls == [call]
    assert result.content == ""


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_several_calls_with_text(fmt: str) -> None:
    calls = [CALLS[0], CALLS[1], CALLS[3]]
    text = format_tool_calls(calls, fmt)
    assert parse_tool_calls(text, TOOLS, fmt).calls == calls
    if fmt != "llama3":  # llama3 is plain JSON: prose around it is tested separately
        result = parse_tool_calls(f"Let me act.\n{text}\n", TOOLS, fmt)
        assert result.calls == calls
        assert result.content == "Let me act."


def test_exact_rendering() -> None:
    call = ToolCall("choose_square", {"square": 5})
    assert format_tool_call(call, "hermes") == (
        '<tool_call>\n{"name": "choose_square", "arguments": {"square": 5}}\n</tool_call>'
    )
    assert (
        format_tool_call(call, "llama3") == '{"name": "choose_square", "parameters": {"square": 5}}'
    )
    assert format_tool_call(call, "glm") == (
        "<tool_call>choose_square\n<arg_key>square</arg_key>\n<arg_value>5</arg_value>\n</tool_call>"
    )
    assert format_tool_call(call, "mistral") == (
        '[TOOL_CALLS][{"name": "choose_square", "arguments": {"square": 5}}]'
    )
    two = format_tool_calls([call, ToolCall("get_board", {})], "mistral")
    assert two.count("[TOOL_CALLS]") == 1
    assert format_tool_call(ToolCall("search", {"query": "a b"}), "glm") == (
        "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>a b</arg_value>\n</tool_call>"
    )
    with pytest.raises(ValueError):
        format_tool_call(call, "nope")
    with pytest.raises(ValueError):
        parse_tool_calls("", TOOLS, "nope")


# --- tolerance -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_call_inside_think_is_ignored(fmt: str) -> None:
    call_text = format_tool_call(CALLS[0], fmt)
    result = parse_tool_calls(f"<think>maybe {call_text}</think>I give up.", TOOLS, fmt)
    assert result.failure == "no_tool_call"
    assert result.content == "I give up."
    assert "maybe" in (result.reasoning or "")

    result = parse_tool_calls(f"<think>\nplan\n</think>\n\n{call_text}", TOOLS, fmt)
    assert result.calls == [CALLS[0]]
    assert result.reasoning == "plan"

    unclosed = parse_tool_calls(f"<think>still thinking {call_text}", TOOLS, fmt)
    assert unclosed.failure == "no_tool_call"
    assert unclosed.reasoning is not None and "still thinking" in unclosed.reasoning


def test_think_opened_by_the_template() -> None:
    text = "plan the move</think>\n" + format_tool_call(CALLS[0], "hermes")
    result = parse_tool_calls(text, TOOLS)
    assert result.calls == [CALLS[0]]
    assert result.reasoning == "plan the move"


def test_two_think_blocks_are_joined() -> None:
    text = "<think>a</think>x<think>b</think>" + format_tool_call(CALLS[0], "hermes")
    result = parse_tool_calls(text, TOOLS)
    assert result.reasoning == "a\nb"
    assert result.content == "x"


def test_markdown_fences() -> None:
    body = '{"name": "choose_square", "arguments": {"square": 2}}'
    expected = [ToolCall("choose_square", {"square": 2})]
    hermes = f"<tool_call>\n```json\n{body}\n```\n</tool_call>"
    assert parse_tool_calls(hermes, TOOLS, "hermes").calls == expected
    for fmt in FORMATS:  # a bare fenced JSON call is accepted in every format
        result = parse_tool_calls(f"Here:\n```json\n{body}\n```\nDone.", TOOLS, fmt)
        assert result.calls == expected, fmt
        assert result.content == "Here:\n\nDone."
    llama = '```\n{"name": "choose_square", "parameters": {"square": 2}}\n```'
    assert parse_tool_calls(llama, TOOLS, "llama3").calls == expected


def test_hermes_variants() -> None:
    expected = [ToolCall("choose_square", {"square": 1})]
    params = '<tool_call>{"name": "choose_square", "parameters": {"square": 1}}</tool_call>'
    assert parse_tool_calls(params, TOOLS).calls == expected
    as_string = '<tool_call>{"name": "choose_square", "arguments": "{\\"square\\": 1}"}</tool_call>'
    assert parse_tool_calls(as_string, TOOLS).calls == expected
    # unclosed block whose rest is valid JSON (stop string ate the closing tag): accepted
    unclosed = '<tool_call>\n{"name": "choose_square", "arguments": {"square": 1}}\n'
    assert parse_tool_calls(unclosed, TOOLS).calls == expected
    no_args = '<tool_call>{"name": "get_board"}</tool_call>'
    assert parse_tool_calls(no_args, TOOLS).calls == [ToolCall("get_board", {})]


def test_llama3_variants() -> None:
    one = '{"name": "choose_square", "parameters": {"square": 1}}'
    two = '{"name": "choose_square", "arguments": {"square": 2}}'
    expected = [ToolCall("choose_square", {"square": 1}), ToolCall("choose_square", {"square": 2})]
    for text in (f"<|python_tag|>{one}", f"{one}; {two}", f"{one}\n{two}", f"[{one}, {two}]"):
        result = parse_tool_calls(text, TOOLS, "llama3")
        assert result.calls == expected[: len(result.calls)] and result.calls, text
        assert result.content == ""
    result = parse_tool_calls(f"I will play 1.\n{one}\nGood luck!", TOOLS, "llama3")
    assert result.calls == expected[:1]
    assert result.content == "I will play 1.\n\nGood luck!"


def test_mistral_both_forms() -> None:
    expected = [ToolCall("choose_square", {"square": 4}), ToolCall("get_board", {})]
    listed = (
        '[TOOL_CALLS] [{"name": "choose_square", "arguments": {"square": 4}}, '
        '{"name": "get_board", "arguments": {}}]'
    )
    assert parse_tool_calls(listed, TOOLS, "mistral").calls == expected
    named = '[TOOL_CALLS]choose_square[ARGS]{"square": 4}[TOOL_CALLS]get_board[ARGS]{}'
    assert parse_tool_calls(named, TOOLS, "mistral").calls == expected
    with_id = parse_tool_calls("[TOOL_CALLS]get_board[CALL_ID]abc123XYZ[ARGS]{}", TOOLS, "mistral")
    assert with_id.calls == [ToolCall("get_board", {}, id="abc123XYZ")]
    call = ToolCall("get_board", {}, id="abc123XYZ")
    assert parse_tool_calls(format_tool_call(call, "mistral"), TOOLS, "mistral").calls == [call]


def test_glm_string_coercion() -> None:
    def glm(name: str, **values: str) -> list[ToolCall]:
        pairs = "".join(_kv(k, v) for k, v in values.items())
        result = parse_tool_calls(f"<tool_call>{name}\n{pairs}</tool_call>", TOOLS, "glm")
        assert result.failure is None, result.detail
        return result.calls

    assert glm("choose_square", square="5")[0].arguments == {"square": 5}
    assert glm("search", query="5", limit="2")[0].arguments == {"query": "5", "limit": 2}
    assert glm("search", query='"quoted"')[0].arguments == {"query": '"quoted"'}
    assert glm("search", query="[1, 2]")[0].arguments == {"query": "[1, 2]"}
    args = glm("configure", enabled="true", tags='["x"]', note="null", limits='{"cpu": 2}')
    assert args[0].arguments == {
        "enabled": True,
        "tags": ["x"],
        "note": "null",
        "limits": {"cpu": 2},
    }
    # a property without a declared type: decoded if it is JSON, else kept as text
    assert glm("echo", a="[1,2]", b="plain", c='"x"')[0].arguments == {
        "a": [1, 2],
        "b": "plain",
        "c": "x",
    }


def test_require_call_false() -> None:
    result = parse_tool_calls("Just chatting.", TOOLS, require_call=False)
    assert result == ParseResult([], "Just chatting.", None)
    broken = parse_tool_calls("<tool_call>{oops</tool_call>", TOOLS, require_call=False)
    assert broken.failure == "bad_json"


# --- failure classes ----------------------------------------------------------------------


def _tc(body: str) -> str:
    return f"<tool_call>{body}</tool_call>"


def _sq(args: str) -> str:
    return _tc(f'{{"name": "choose_square", "arguments": {args}}}')


def _kv(key: str, value: str) -> str:
    return f"<arg_key>{key}</arg_key><arg_value>{value}</arg_value>"


FAILURES = [
    ("hermes", "I will not call anything.", "no_tool_call"),
    ("hermes", _sq("{"), "bad_json"),
    ("hermes", _tc('{"arguments": {"square": 1}}'), "bad_json"),
    ("hermes", _tc('{"name": 3, "arguments": {}}'), "bad_json"),
    ("hermes", "<tool_call>\n{'name': 'choose_square'", "bad_json"),
    ("hermes", _tc('["x"]'), "bad_json"),
    ("hermes", _tc('{"name": "fly", "arguments": {}}'), "unknown_tool"),
    ("hermes", _sq("[5]"), "bad_arguments"),
    ("hermes", _sq('"{x"'), "bad_arguments"),
    ("hermes", _sq("{}"), "bad_arguments"),
    ("llama3", "The best square is 4.", "no_tool_call"),
    ("llama3", '{"name": "choose_square", "parameters": {"square": }', "bad_json"),
    ("llama3", '{"parameters": {"square": 1}}', "bad_json"),
    ("llama3", '<|python_tag|>{"name": "fly", "parameters": {}}', "unknown_tool"),
    ("llama3", '{"name": "choose_square", "parameters": {"square": 9}}', "bad_arguments"),
    ("glm", "no call here", "no_tool_call"),
    ("glm", "<tool_call>choose_square<arg_key>square</arg_key>", "bad_json"),
    ("glm", _tc(_kv("square", "1")), "bad_json"),
    ("glm", _tc("choose_square<arg_key>square<arg_value>1</arg_value>"), "bad_json"),
    ("glm", _tc("choose square now"), "bad_json"),
    ("glm", _tc("fly" + _kv("a", "1")), "unknown_tool"),
    ("glm", _tc("choose_square" + _kv("square", "x")), "bad_arguments"),
    ("mistral", "Square four.", "no_tool_call"),
    ("mistral", "[TOOL_CALLS] [{'name': 'choose_square'}]", "bad_json"),
    ("mistral", "[TOOL_CALLS]choose_square[ARGS]{square: 1}", "bad_json"),
    ("mistral", "[TOOL_CALLS][]", "bad_json"),
    ("mistral", '[TOOL_CALLS][{"name": "fly", "arguments": {}}]', "unknown_tool"),
    ("mistral", '[TOOL_CALLS]choose_square[ARGS]{"square": -1}', "bad_arguments"),
]


@pytest.mark.parametrize(("fmt", "text", "failure"), FAILURES)
def test_failure_classes(fmt: str, text: str, failure: str) -> None:
    result = parse_tool_calls(text, TOOLS, fmt)
    assert result.failure == failure, result.detail
    _assert_well_formed(result)


@pytest.mark.parametrize("fmt", FORMATS)
def test_first_failure_wins(fmt: str) -> None:
    good = ToolCall("choose_square", {"square": 1})
    unknown = ToolCall("fly", {})
    bad_args = ToolCall("choose_square", {"square": 99})
    result = parse_tool_calls(format_tool_calls([good, unknown, bad_args], fmt), TOOLS, fmt)
    assert (result.failure, result.calls) == ("unknown_tool", [])
    result = parse_tool_calls(format_tool_calls([good, bad_args, unknown], fmt), TOOLS, fmt)
    assert (result.failure, result.calls) == ("bad_arguments", [])
    assert "maximum" in (result.detail or "")


def test_validate_arguments() -> None:
    assert validate_arguments(ToolCall("choose_square", {"square": 3}), TOOLS) is None
    assert "required" in (validate_arguments(ToolCall("choose_square", {}), TOOLS) or "")
    assert validate_arguments(ToolCall("echo", {"x": 1}), TOOLS) is None
    assert validate_arguments(ToolCall("fly", {}), TOOLS) is not None
    broken = [_fn("odd", {"type": "no-such-type"})]
    detail = validate_arguments(ToolCall("odd", {}), broken)
    assert detail is not None and len(detail) <= 200
    result = parse_tool_calls('<tool_call>{"name": "odd", "arguments": {}}</tool_call>', broken)
    assert result.failure == "bad_arguments"
    bad_regex = [_fn("odd", {"properties": {"a": {"type": "string", "pattern": "("}}})]
    result = parse_tool_calls(_tc('{"name": "odd", "arguments": {"a": "x"}}'), bad_regex)
    assert result.failure == "bad_arguments"


@pytest.mark.parametrize(
    ("template", "model", "expected"),
    [
        ("...<arg_key>{{ k }}</arg_key>...<tool_call>", "", "glm"),
        ("{{ '[TOOL_CALLS]' }}", "", "mistral"),
        ("{{ '<|python_tag|>' }}", "", "llama3"),
        ("{% if message.role == 'ipython' %}", "", "llama3"),
        ("<tool_call>\n{{ tool_call | tojson }}", "", "hermes"),
        (None, "inclusionAI/Ling-lite-1.5", "glm"),
        ("{{ messages }}", "zai-org/GLM-4.5-Air", "glm"),
        (None, "mistralai/Mistral-7B-Instruct-v0.3", "mistral"),
        (None, "meta-llama/Llama-3.2-1B-Instruct", "llama3"),
        (None, "HuggingFaceTB/SmolLM2-135M-Instruct", "hermes"),
        (None, "some/sampling-model", "hermes"),
        (None, "", "hermes"),
    ],
)
def test_detect_format(template: str | None, model: str, expected: str) -> None:
    assert detect_format(template, model) == expected


# --- robustness -----------------------------------------------------------------------------

HUGE = [
    "<tool_call>" * 100_000,
    '{"name":' * 100_000,
    "[" * 1_000_000,
    "<think>" * 150_000,
    "[TOOL_CALLS]" * 90_000,
    "<tool_call>a<arg_key>" * 50_000,
    "<tool_call>a<arg_key>k</arg_key><arg_value>" * 25_000,
    " " * 1_000_000 + "{",
    "`" * 1_000_000,
    '{"name": "' + "a" * 1_000_000,
    "{" + " " * 1_000_000,
    "[TOOL_CALLS]" + "a" * 1_000_000,
    # 3,000 well-formed calls: linear work of ≈ 20 µs a call, far under the bound on a slow machine,
    # while a quadratic scan of these 234 KB would far exceed it.
    format_tool_call(CALLS[0], "hermes") * 3_000,
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_huge_inputs_are_fast(fmt: str) -> None:
    # This thread's CPU time, not wall-clock: a guard against quadratic parsing that a busy
    # machine cannot trip, nor other threads of the test process (a fixture's server).
    for text in HUGE:
        start = time.thread_time()
        result = parse_tool_calls(text, TOOLS, fmt)
        assert time.thread_time() - start < 1.0, text[:40]
        _assert_well_formed(result)


@pytest.mark.parametrize("fmt", FORMATS)
def test_odd_characters(fmt: str) -> None:
    for text in ("\ud800<tool_call>\udfff", "\x00\x01\x1b[0m{", '{"name": "\ud800"}', "\u2028"):
        _assert_well_formed(parse_tool_calls(text, TOOLS, fmt))
    call = ToolCall("search", {"query": "\ud83d lone \x00 control \n"})
    assert parse_tool_calls(format_tool_call(call, fmt), TOOLS, fmt).calls == [call]


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "{",
    "}",
    "[",
    "]",
    '"name"',
    '"arguments"',
    '"parameters"',
    ":",
    ",",
    ";",
    "\n",
    " ",
    '"choose_square"',
    '"fly"',
    "5",
    "99",
    "null",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "choose_square",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "<|python_tag|>",
    "```json",
    "```",
    *(format_tool_call(CALLS[0], fmt) for fmt in FORMATS),
]
any_chars = st.characters(exclude_categories=())  # surrogates and control characters too
messy_text = st.lists(
    st.one_of(st.text(alphabet=any_chars, max_size=20), st.sampled_from(FRAGMENTS)), max_size=30
).map("".join)


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(st.text(alphabet=any_chars), messy_text), require_call=st.booleans())
def test_never_raises(text: str, require_call: bool) -> None:
    for fmt in FORMATS:
        _assert_well_formed(parse_tool_calls(text, TOOLS, fmt, require_call), require_call)


# Markup inside argument values (`<think>`, `</tool_call>`) is ambiguous in these text formats
# for models too, so round-trip values avoid "<".
plain_text = st.text(alphabet=st.characters(exclude_characters="<"))
random_calls = st.one_of(
    st.builds(lambda n: ToolCall("choose_square", {"square": n}), st.integers(0, 8)),
    st.builds(
        lambda q, lim: ToolCall("search", {"query": q, **({"limit": lim} if lim else {})}),
        plain_text,
        st.one_of(st.none(), st.integers(1, 10**12)),
    ),
    st.builds(
        lambda b, tags: ToolCall("configure", {"enabled": b, "tags": tags}),
        st.booleans(),
        st.lists(plain_text, max_size=4),
    ),
)


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(random_calls, min_size=1, max_size=3))
def test_round_trip_random_arguments(calls: list[ToolCall]) -> None:
    for fmt in FORMATS:
        result = parse_tool_calls(format_tool_calls(calls, fmt), TOOLS, fmt)
        assert result.failure is None, (fmt, result.detail)
        assert result.calls == calls, fmt
