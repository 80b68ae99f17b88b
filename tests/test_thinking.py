"""The glm (GLM-4.5, Ling) call syntax end to end, thinking before a forced call, and
multi-turn episodes whose template drops earlier turns' thinking."""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import xgrammar as xgr
from hypothesis import given
from hypothesis import strategies as st

from looprl.chat import ChatRenderer
from looprl.chat.formats import format_tool_call
from looprl.chat.parsers import parse_tool_calls, validate_arguments
from looprl.engine import GenerationRequest, SamplingParams, Thinking, ToolConstraint
from looprl.engine.grammar import GrammarCache, build_grammar, call_schema, thinking_marks
from looprl.engine.hf import HFEngine
from looprl.envs.builtin.tictactoe import (
    CHOOSE_SQUARE_TOOL,
    TicTacToeGame,
    TicTacToeMove,
    legal_moves,
)
from looprl.envs.builtin.workflow import TOOLS as WORKFLOW_TOOLS
from looprl.envs.check import random_value
from looprl.errors import ChatError
from looprl.loop.rollout import run_episodes
from looprl.types import Message, ToolCall
from tests.test_chat_render import NATIVE_TEMPLATE
from tests.test_engine import full_forward_logprobs
from tests.test_rollout import ScriptedEngine, check_alignment, encode, last_board

TEMPLATES = Path(__file__).parent / "templates"
FORMATS = ("hermes", "llama3", "mistral", "glm")


def _tool(**properties) -> dict:
    required = [k for k in properties if not k.startswith("opt_")]
    params = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": "f", "parameters": params}}


TYPED = _tool(
    n={"type": "integer", "minimum": 1, "maximum": 9},
    x={"type": "number"},
    flag={"type": "boolean"},
    word={"type": "string", "enum": ["red", "green"]},
    shade={"enum": ["dark", "light"]},  # no type: written as text too
    text={"type": "string", "maxLength": 12},
    items={"type": "array", "items": {"type": "integer"}},
    opt_note={"type": "string"},
)


@pytest.fixture(scope="module")
def ling_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (TEMPLATES / "ling.jinja").read_text()
    return tok


@pytest.fixture(scope="module")
def ling(ling_tokenizer):
    return ChatRenderer(ling_tokenizer, model_name="ling-like")


@pytest.fixture(scope="module")
def grammars(tokenizer, renderer):
    return GrammarCache(tokenizer, len(tokenizer), renderer.eos_ids)


def accepts(grammars, tokenizer, constraint, text: str) -> bool:
    """Whether the forced grammar takes `text` as a whole reply (then EOS)."""
    matcher = grammars.matcher(constraint)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(
        tokenizer.eos_token_id
    )


# ------------------------------------------------------------ template → call syntax


@pytest.mark.parametrize(
    ("template", "fmt"),
    [("hermes", "hermes"), ("ling.jinja", "glm"), ("llama3.jinja", "llama3"),
     ("mistral.jinja", "mistral"), ("smollm2", "hermes")],
)  # fmt: skip
def test_auto_picks_the_call_syntax_of_each_template(tokenizer, template, fmt):
    tok = copy.deepcopy(tokenizer)
    if template == "hermes":
        tok.chat_template = NATIVE_TEMPLATE
    elif template != "smollm2":  # the tiny model's own template: SmolLM2's, no tools
        tok.chat_template = (TEMPLATES / template).read_text()
    renderer = ChatRenderer(tok, model_name="some-model")
    assert renderer.format == fmt
    assert renderer.native_tools is (template != "smollm2")
    # what the model writes for a call is read back as that call
    call = ToolCall("choose_square", {"square": 7})
    parsed = renderer.parse(format_tool_call(call, fmt), [CHOOSE_SQUARE_TOOL])
    assert parsed.failure is None and parsed.calls == [call]


def test_ling_template_writes_calls_as_formats_does(ling):
    call = ToolCall("choose_square", {"square": 7})
    text = ling.render_text(
        [Message("user", "go"), Message("assistant", "", tool_calls=[call])], [CHOOSE_SQUARE_TOOL]
    )
    assert "<|im_start|>assistant\n" + format_tool_call(call, "glm") + "<|im_end|>" in text


# ------------------------------------------------------------ the glm grammar


def test_glm_grammar_takes_what_formats_writes_typed_by_the_schema(grammars, tokenizer):
    forced = ToolConstraint([TYPED], "required", "glm")
    good = {"n": 3, "x": 2.5, "flag": True, "word": "red", "shade": "dark", "text": "a b"}
    good["items"] = [1, 2]
    assert accepts(grammars, tokenizer, forced, format_tool_call(ToolCall("f", good), "glm"))
    with_optional = {**good, "opt_note": "fine"}
    assert accepts(
        grammars, tokenizer, forced, format_tool_call(ToolCall("f", with_optional), "glm")
    )
    for bad in (
        {**good, "n": 10},  # above maximum
        {**good, "n": "three"},  # not an integer
        {**good, "flag": "yes"},
        {**good, "word": "blue"},  # not in the enum
        {**good, "shade": "mid"},
        {**good, "text": "far too long a text"},  # over maxLength
        {**good, "text": "a<b"},  # '<' could open a tag inside the value
        {k: v for k, v in good.items() if k != "x"},  # a required argument left out
        {**good, "extra": 1},  # not in the schema
    ):
        assert not accepts(grammars, tokenizer, forced, format_tool_call(ToolCall("f", bad), "glm"))


def test_glm_grammar_keeps_the_schema_property_order(grammars, tokenizer):
    forced = ToolConstraint([TYPED], "required", "glm")
    args = {"x": 2.5, "n": 3, "flag": True, "word": "red", "shade": "dark", "text": "", "items": []}
    assert not accepts(grammars, tokenizer, forced, format_tool_call(ToolCall("f", args), "glm"))


@given(seed=st.integers(0, 2**32 - 1))
def test_every_call_the_glm_grammar_takes_parses_back(grammars, tokenizer, seed):
    """Random valid arguments of the workflow tools: the grammar takes them as formats.py
    writes them, and the parser gives the same call back."""
    rng = random.Random(seed)
    tool = rng.choice(WORKFLOW_TOOLS)
    fn = tool["function"]
    args = random_value(fn["parameters"], rng)
    args = {k: v.replace("<", "") if isinstance(v, str) else v for k, v in args.items()}
    call = ToolCall(fn["name"], args)
    if validate_arguments(call, WORKFLOW_TOOLS) is not None:
        return  # random_value may break a limit; only valid calls can be forced
    text = format_tool_call(call, "glm")
    forced = ToolConstraint(WORKFLOW_TOOLS, "required", "glm")
    assert accepts(grammars, tokenizer, forced, text)
    parsed = parse_tool_calls(text, WORKFLOW_TOOLS, "glm")
    assert parsed.failure is None and parsed.calls == [call]


def test_glm_grammar_refuses_schemas_it_cannot_honour():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}  # fmt: skip
    with pytest.raises(ChatError, match="anyOf cannot be forced"):
        build_grammar(ToolConstraint([tool], "required", "glm"))


@pytest.mark.parametrize("jump_forward", [True, False])
def test_forced_glm_calls_from_the_tiny_model_parse(tiny_model, ling_tokenizer, ling, jump_forward):
    env = TicTacToeMove()
    obs = env.reset(env.tasks("eval", n=1)[0])
    prompt = ling.prompt_ids(obs.messages, obs.tools)
    engine = HFEngine(tiny_model, ling_tokenizer, ling.eos_ids, jump_forward=jump_forward)
    requests = [GenerationRequest(prompt, ToolConstraint(obs.tools, "required", "glm"))] * 4
    outs = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=80, seed=5))
    for out in outs:
        assert out.finish_reason == "stop"
        parsed = ling.parse(ling.decode(out.ids), obs.tools)
        assert parsed.failure is None and len(parsed.calls) == 1
        assert parsed.calls[0].arguments["square"] in range(1, 10)
        assert_exact_logprobs(tiny_model, prompt, out)


# ------------------------------------------------------------ thinking before the call


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_without_thinking_the_grammar_is_the_call_alone(fmt):
    """think off: the grammar is exactly the one forced calls always had."""
    key = "parameters" if fmt == "llama3" else "arguments"
    constraint = ToolConstraint([CHOOSE_SQUARE_TOOL], "required", fmt)
    schema = xgr.Grammar.from_json_schema(
        json.dumps(call_schema(constraint, key)), any_whitespace=False
    )
    literal = lambda text: xgr.Grammar.from_ebnf("root ::= " + json.dumps(text))  # noqa: E731
    before = {
        "hermes": [literal("<tool_call>\n"), schema, literal("\n</tool_call>")],
        "llama3": [schema],
        "mistral": [literal("[TOOL_CALLS]["), schema, literal("]")],
    }[fmt]
    assert str(build_grammar(constraint)) == str(xgr.Grammar.concat(*before))
    assert constraint.thinking == Thinking("off", 0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_thinking_grammar_shape(grammars, tokenizer, fmt):
    call = format_tool_call(ToolCall("choose_square", {"square": 5}), fmt)
    tagged = ToolConstraint([CHOOSE_SQUARE_TOOL], "required", fmt, Thinking("tagged", 50))
    plain = ToolConstraint([CHOOSE_SQUARE_TOOL], "required", fmt, Thinking("plain", 50))
    off = ToolConstraint([CHOOSE_SQUARE_TOOL], "required", fmt)
    assert accepts(grammars, tokenizer, tagged, "<think>if a < b, 5.\nYes</think>\n" + call)
    assert accepts(grammars, tokenizer, tagged, "<think></think>\n" + call)
    assert accepts(grammars, tokenizer, plain, "The centre is free.\n" + call)
    assert accepts(grammars, tokenizer, off, call)
    assert not accepts(grammars, tokenizer, off, "<think>x</think>\n" + call)
    assert not accepts(grammars, tokenizer, tagged, call)  # the thinking block comes first
    assert not accepts(grammars, tokenizer, tagged, "<think>a</b></think>\n" + call)
    assert not accepts(grammars, tokenizer, tagged, "<think>x</think>\n" + call + "\n" + call)
    assert not accepts(grammars, tokenizer, tagged, "<think>x</think>\nDone.")
    opening = {"hermes": "<", "glm": "<", "llama3": "{", "mistral": "["}[fmt]
    assert not accepts(grammars, tokenizer, plain, f"a {opening} b\n" + call)


def test_a_generation_prompt_that_opens_thinking_gets_no_second_opening(
    grammars, tokenizer, renderer
):
    """Templates that end their generation prompt with `<think>` (DeepSeek-R1 distills,
    Qwen3 thinking models): the renderer sees it, and the tagged grammar then starts
    inside the block instead of forcing a second `<think>`."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = tok.chat_template.replace(
        "<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n"
    )
    opening = ChatRenderer(tok, model_name="r1-like")
    assert opening.render_text([Message(role="user", content="x")], None).endswith("<think>\n")
    assert opening.opens_thinking and not renderer.opens_thinking
    call = format_tool_call(ToolCall("choose_square", {"square": 5}), "hermes")
    inside = ToolConstraint(
        [CHOOSE_SQUARE_TOOL], "required", "hermes", Thinking("tagged", 50, True)
    )
    assert accepts(grammars, tokenizer, inside, "the centre.</think>\n" + call)
    outside = ToolConstraint([CHOOSE_SQUARE_TOOL], "required", "hermes", Thinking("tagged", 50))
    assert not accepts(grammars, tokenizer, outside, "the centre.</think>\n" + call)
    text = "the centre.</think>\n" + call  # the parser sets the reasoning aside all the same
    message, reasoning = opening.assistant_reply(text, [CHOOSE_SQUARE_TOOL], require_call=True)
    assert [c.name for c in message.tool_calls] == ["choose_square"]
    assert reasoning == "the centre." and not message.content


def _tokens_to_close(tokenizer, ids: list[int], mode: str, fmt: str) -> int:
    """The number of the token that starts the closing: tagged thinking cannot hold
    `</`, nor plain thinking the first character of the call's opening."""
    marker = "</" if mode == "tagged" else {"llama3": "{", "mistral": "["}.get(fmt, "<")
    return next(n for n in range(len(ids) + 1) if marker in tokenizer.decode(ids[:n]))


def assert_exact_logprobs(model, prompt: list[int], out) -> None:
    reference = full_forward_logprobs(model, prompt, out.ids)
    assert max(abs(a - b) for a, b in zip(reference, out.logprobs)) < 1e-4


@pytest.mark.parametrize(
    ("fmt", "mode", "jump_forward"),
    [(fmt, mode, True) for fmt in FORMATS for mode in ("tagged", "plain")]
    + [("glm", "tagged", False), ("hermes", "plain", False)],
)
def test_thinking_then_exactly_one_valid_call_within_the_limit(
    tiny_model, tokenizer, renderer, fmt, mode, jump_forward
):
    limit = 9
    env = TicTacToeMove()
    obs = env.reset(env.tasks("eval", n=1)[0])
    prompt = renderer.prompt_ids(obs.messages, obs.tools)
    constraint = ToolConstraint(obs.tools, "required", fmt, Thinking(mode, limit))
    engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids, jump_forward=jump_forward)
    params = SamplingParams(temperature=1.0, max_new_tokens=90, seed=11)
    outs = engine.generate([GenerationRequest(prompt, constraint)] * 4, params)
    closing = len(tokenizer.encode(thinking_marks(constraint.thinking, fmt)[1]))
    at_limit = 0
    for out in outs:
        assert out.finish_reason == "stop"
        text = tokenizer.decode(out.ids, skip_special_tokens=True)
        parsed = parse_tool_calls(text, obs.tools, fmt)
        assert parsed.failure is None and len(parsed.calls) == 1, text
        if mode == "tagged":  # the thinking is set aside, the visible text is the call
            assert text.startswith("<think>") and "</think>\n" in text
            assert parsed.content == "" and "<think>" not in (parsed.reasoning or "")
        else:  # the thinking is the message's text
            opening = {"llama3": "{", "mistral": "["}.get(fmt, "<")
            assert parsed.content == text[: text.index(opening)].strip()
            assert parsed.reasoning is None
        n = _tokens_to_close(tokenizer, out.ids, mode, fmt)
        assert n <= limit + closing + 1, text  # +1: a character split over two tokens
        at_limit += n >= limit
        assert_exact_logprobs(tiny_model, prompt, out)
    assert at_limit >= 1  # a random model rarely closes by itself: the limit did it


def test_think_config_needs_room_for_the_call():
    from looprl.config import load_config
    from looprl.errors import ConfigError

    with pytest.raises(ConfigError, match="think_max_tokens"):
        load_config(None, ["rollout.think=tagged", "rollout.think_max_tokens=64"])
    cfg = load_config(None, ["rollout.think=plain", "rollout.think_max_tokens=16"])
    assert (cfg.rollout.think, cfg.rollout.think_max_tokens) == ("plain", 16)


# ------------------------------------------------------------ multi-turn continuity


def _scripted_game(tokenizer, think: bool):
    """A script that takes the first empty square each turn, thinking first or not."""

    def script(prompt_text: str) -> list[int]:
        square = legal_moves(last_board(prompt_text))[0]
        call = format_tool_call(ToolCall("choose_square", {"square": square}), "glm")
        thought = f"<think>Square {square} is free.</think>\n" if think else ""
        return encode(tokenizer, thought + call)

    return ScriptedEngine(tokenizer, script)


@pytest.mark.parametrize("think", [True, False])
def test_multi_turn_keeps_thinking_as_sampled_and_counts_the_mismatch(ling_tokenizer, ling, think):
    engine = _scripted_game(ling_tokenizer, think)
    tasks = TicTacToeGame().tasks("eval", n=2)
    episodes = run_episodes(
        tasks, lambda: TicTacToeGame("random", "X"), engine, ling,
        SamplingParams(max_new_tokens=120), max_turns=5, max_episode_tokens=4000,
    )  # fmt: skip
    for ep in episodes:
        check_alignment(ep)
        assert len(ep.turns) >= 2
        second_prompt = ling_tokenizer.decode(ep.turns[1].prompt_ids)
        first = ep.turns[0]
        # the record grows by appending: the first completion, thinking and all, is kept
        assert ep.turns[1].prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == (
            first.prompt_ids + first.completion_ids
        )
        assert ("<think>Square" in second_prompt) is think
        # the template drops the thinking of earlier turns: the record and its rendering
        # part where the first completion begins; without thinking they agree
        if think:
            start = len(first.prompt_ids)
            assert start <= ep.info["retokenize_mismatch"] < start + len(first.completion_ids)
        else:
            assert "retokenize_mismatch" not in ep.info


def test_multi_turn_with_the_hf_engine_and_thinking(tiny_model, ling_tokenizer, ling):
    engine = HFEngine(tiny_model, ling_tokenizer, ling.eos_ids)
    tasks = TicTacToeGame().tasks("eval", n=6)
    episodes = run_episodes(
        tasks, lambda: TicTacToeGame("random", "X"), engine, ling,
        SamplingParams(temperature=1.0, max_new_tokens=80, seed=2), max_turns=5,
        max_episode_tokens=4000, thinking=Thinking("tagged", 8),
    )  # fmt: skip
    several = [ep for ep in episodes if len(ep.turns) >= 2]
    assert several, [ep.outcome for ep in episodes]
    for ep in episodes:
        check_alignment(ep)
        for turn, message in zip(ep.turns, [m for m in ep.messages if m.role == "assistant"]):
            assert turn.text.startswith("<think>") and "</think>" in turn.text
            assert message.parse_failure is None and len(message.tool_calls) == 1
    for ep in several:
        start, first = len(ep.turns[0].prompt_ids), ep.turns[0].completion_ids
        assert start <= ep.info["retokenize_mismatch"] < start + len(first)


# ------------------------------------------------------------ the CLI


def test_looprl_run_with_thinking(tmp_path):
    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "looprl.cli", "run", "--out", str(run),
        "--set", "model.name=tiny-random", "--set", "env.name=tictactoe-move",
        "--set", "rollout.tasks_per_step=2", "--set", "rollout.group_size=2",
        "--set", "rollout.max_new_tokens=64", "--set", "rollout.think=tagged",
        "--set", "rollout.think_max_tokens=8", "--set", "eval.tasks=2",
        "--set", "eval.samples_per_task=1", "--set", "train.steps=1",
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["rollout/valid_tool_call_rate"] == 1.0
    assert metrics[-1]["rollout/retokenize_mismatch"] == 0  # one turn: nothing to differ
    final = [
        json.loads(line) for line in (run / "samples" / "final.jsonl").read_text().splitlines()
    ]
    for record in final:
        assert record["completions"][0].startswith("<think>")
        assert "</think>" in record["completions"][0]
        assistant = [m for m in record["messages"] if m["role"] == "assistant"]
        assert len(assistant[0]["tool_calls"]) == 1
