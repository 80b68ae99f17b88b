"""`response_format` JSON replies: the supported schema subset, and replies that satisfy
their schema every time, sampled at temperature 1 on the tiny random model (so that the
grammar alone is what makes them valid)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from looprl.apps.inference import ChatModel
from looprl.apps.loading import load_chat_model
from looprl.engine import JsonConstraint, SamplingParams
from looprl.engine.json_schema import unsupported_features
from looprl.engine.requests import generation_request, json_constraint
from looprl.errors import RequestError
from looprl.types import Message

# ---------------------------------------------------------------- the subset (no model)


def _accepts(schema: dict, value: object) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_json_schema(
        json.dumps(schema), any_whitespace=False, strict_mode=True
    )
    return _is_grammar_accept_string(grammar, json.dumps(value))


# keyword → (a schema using it, a value the schema rejects)
IGNORED_BY_THE_COMPILER = {
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, 1),
    "not": ({"not": {"type": "integer"}}, 1),
    "if": ({"if": {"type": "integer"}, "then": {"minimum": 1}}, 0),
    "contains": ({"type": "array", "items": {}, "contains": {"type": "integer"}}, ["a"]),
    "dependentRequired": (
        {"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
        {"a": 1},
    ),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1]),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, 1),
}


@pytest.mark.parametrize("keyword", sorted(IGNORED_BY_THE_COMPILER))
def test_what_we_refuse_is_what_the_compiler_ignores(keyword):
    schema, bad = IGNORED_BY_THE_COMPILER[keyword]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    # if this fails, xgrammar now enforces the keyword: support it instead of refusing it
    assert _accepts(schema, bad), f"the grammar compiler now enforces {keyword}"
    assert unsupported_features(schema), f"{keyword} must be refused"


@pytest.mark.parametrize(
    "schema, bad",
    [
        ({"type": "integer", "minimum": 1, "maximum": 9}, 10),
        ({"type": "string", "pattern": "^a+$"}, "b"),
        ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, [1, 2]),
        ({"enum": ["x", "y"]}, "z"),
        ({"type": "string", "format": "date"}, "tuesday"),
        ({"$defs": {"A": {"type": "integer"}}, "type": "object",
          "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]}, {"a": "x"}),
        ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                     "required": ["a"]}]}, {}),
    ],
)  # fmt: skip
def test_what_we_accept_is_enforced(schema, bad):
    assert unsupported_features(schema) == []
    assert not _accepts(schema, bad)


def test_unsupported_features_name_where_they_are():
    schema = {
        "type": "object",
        "properties": {
            "not": {"type": "string"},  # a property *named* "not" is fine
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            "pick": {"anyOf": [{"type": "integer"}, {"oneOf": [{"type": "string"}]}]},
        },
        "$defs": {"Ext": {"$ref": "https://example.com/schema.json"}},
    }
    found = unsupported_features(schema)
    assert [f.split(":")[0] for f in found] == [
        "properties.tags",
        "properties.pick.anyOf[1]",
        "$defs.Ext",
    ]


@pytest.mark.parametrize(
    "response_format, tools, tool_choice, param, words",
    [
        ({"type": "xml"}, None, "none", "response_format.type", "json_schema"),
        ({"type": "json_schema"}, None, "none", "response_format.json_schema", "name"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "blob"}}},
         None, "none", "response_format.json_schema.schema", "not a valid JSON schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}},
         None, "none", "response_format.json_schema.schema", "(root): not"),
    ],
)  # fmt: skip
def test_bad_response_formats_are_refused(response_format, tools, tool_choice, param, words):
    with pytest.raises(RequestError) as err:
        json_constraint(response_format, tools, tool_choice, "hermes")
    assert err.value.param == param and words in str(err.value)


def test_response_format_text_or_none_is_no_constraint():
    assert json_constraint(None, None, "none", "hermes") is None
    assert json_constraint({"type": "text"}, None, "none", "hermes") is None
    tools = [{"function": {"name": "f"}}]
    constraint = json_constraint({"type": "json_object"}, tools, "auto", "hermes")
    assert constraint == JsonConstraint(None, tools, "hermes")


# ---------------------------------------------------------------- replies (tiny model)


@pytest.fixture(scope="module")
def model() -> ChatModel:
    return load_chat_model("tiny-random", device="cpu")


def _leaf() -> st.SearchStrategy[dict]:
    """A property schema the tiny model can finish: strings carry a maxLength (a random
    model rarely closes a free string), arrays a maxItems."""
    bounds = st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(lambda t: (t[0], t[0] + t[1]))
    return st.one_of(
        st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
        st.integers(0, 3).map(lambda n: {"type": "string", "minLength": n, "maxLength": n + 3}),
        bounds.map(lambda b: {"type": "integer", "minimum": b[0], "maximum": b[1]}),
        st.just({"type": "integer"}),
        bounds.map(lambda b: {"type": "number", "minimum": b[0], "maximum": b[1]}),
        st.just({"type": "boolean"}),
        st.lists(
            st.sampled_from(["red", "green", "blue", "x y", "é"]),
            min_size=1,
            max_size=4,
            unique=True,
        ).map(lambda e: {"enum": e}),  # fmt: skip
    )


def _object(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    names = st.sampled_from(["a", "name", "count", "ok", "when", "tags", "inner"])
    props = st.dictionaries(names, children, min_size=1, max_size=4)
    return props.flatmap(
        lambda p: st.lists(st.sampled_from(sorted(p)), unique=True).map(
            lambda req: {"type": "object", "properties": p, "required": req}
        )
    )


def _array(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.tuples(children, st.integers(0, 3)).map(
        lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}
    )


SCHEMAS = _object(
    st.recursive(_leaf(), lambda inner: st.one_of(_object(inner), _array(inner)), max_leaves=6)
)


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=SCHEMAS)
def test_json_replies_satisfy_generated_schemas(model, schema):
    assert unsupported_features(schema) == []
    prompt = model.renderer.prompt_ids([Message(role="user", content="Reply in JSON.")], None)
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    request = generation_request(
        prompt, None, "none", model.renderer.format, engine=model.engine,
        response_format=response_format,
    )  # fmt: skip
    params = SamplingParams(temperature=1.0, max_new_tokens=400, seed=7)
    for completion in model.engine.generate([request] * 3, params):
        text = model.renderer.decode(completion.ids)
        assert completion.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_chat_json_object_and_schema_replies(model):
    schema = {
        "type": "object",
        "properties": {"square": {"type": "integer", "minimum": 1, "maximum": 9},
                       "why": {"enum": ["win", "block", "centre"]}},
        "required": ["square", "why"],
    }  # fmt: skip
    response_format = {"type": "json_schema", "json_schema": {"name": "move", "schema": schema}}
    hi = [Message(role="user", content="Your move?")]
    for choice in model.chat(hi, response_format=response_format, n=4, max_tokens=64, seed=3):
        assert choice.finish_reason == "stop" and choice.error is None
        jsonschema.validate(json.loads(choice.message.content), schema)
    cut = model.chat(hi, response_format=response_format, max_tokens=3, seed=3)[0]
    assert cut.finish_reason == "length" and cut.message.content == ""
    assert "max_tokens=3" in cut.error
