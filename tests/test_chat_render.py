"""Chat rendering: fallback and native tools, and token-in/token-out across many turns."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

import pytest

from looprl.chat import ChatRenderer
from looprl.chat.formats import format_tool_call
from looprl.envs.builtin.tictactoe import CHOOSE_SQUARE_TOOL, TicTacToeGame, legal_moves
from looprl.errors import ChatError
from looprl.types import Message, Task, ToolCall

TOOLS = [CHOOSE_SQUARE_TOOL]
GEN_PROMPT = "<|im_start|>assistant\n"

# A small Qwen-like template that renders tools itself: a system block listing the tool
# schemas, assistant calls as <tool_call> JSON, tool results as <tool_response> user turns.
NATIVE_TEMPLATE = r"""
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if messages[0].role == 'system' -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
  {{- '# Tools\n<tools>' -}}
  {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\n</tools>\nCall a tool as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>' -}}
  {{- '<|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
  {%- if message.role == 'user' -%}
    {{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' -}}
  {%- elif message.role == 'assistant' -%}
    {{- '<|im_start|>assistant\n' + message.content -}}
    {%- for call in (message.get('tool_calls') or []) -%}
      {%- if message.content or not loop.first -%}{{- '\n' -}}{%- endif -%}
      {{- '<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' -}}
      {{- (call.function.arguments | tojson) + '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif message.role == 'tool' -%}
    {{- '<|im_start|>user\n<tool_response>\n' + message.content -}}
    {{- '\n</tool_response><|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""


@pytest.fixture(scope="module")
def native_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = NATIVE_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def native_renderer(native_tokenizer):
    return ChatRenderer(native_tokenizer, model_name="qwen-like")


@pytest.fixture(params=["fallback", "native"])
def any_renderer(request, renderer, native_renderer):
    return renderer if request.param == "fallback" else native_renderer


def _game_obs():
    env = TicTacToeGame(opponent="random", agent_plays="X")
    task = Task(id="g", data={"agent": "X", "opponent": "random"}, seed=3)
    return env, task, env.reset(task)


def _call_text(square: int) -> str:
    return format_tool_call(ToolCall("choose_square", {"square": square}), "hermes")


# ------------------------------------------------------------------ tools in the prompt


def test_smollm2_template_uses_fallback_tool_block(renderer):
    assert renderer.native_tools is False
    assert renderer.format == "hermes"
    _, _, obs = _game_obs()
    text = renderer.render_text(obs.messages, obs.tools)
    assert text.endswith(GEN_PROMPT)
    schema = json.dumps(CHOOSE_SQUARE_TOOL, ensure_ascii=False)
    start, end = text.index("<tools>\n"), text.index("\n</tools>")
    assert start < text.index(schema) < end
    assert "To call a tool, write the call exactly in this form:" in text
    assert '<tool_call>\n{"name": "<tool name>", "arguments": {"<argument>": "<value>"}}' in text
    # the block joins the environment's own system prompt: one system turn, in first place
    assert text.startswith("<|im_start|>system\n" + obs.messages[0].content + "\n\n# Tools")
    assert text.count("<|im_start|>system") == 1
    assert "<|im_start|>user\n" + obs.messages[1].content + "<|im_end|>" in text


def test_fallback_block_added_when_there_is_no_system_message(renderer):
    text = renderer.render_text([Message("user", "hi")], TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert "SmolLM" not in text  # the template's default system prompt is replaced
    assert '"choose_square"' in text


def test_no_tools_no_block(renderer):
    text = renderer.render_text([Message("system", "sys"), Message("user", "hi")], None)
    assert "<tools>" not in text
    assert (
        text == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n" + GEN_PROMPT
    )


def test_native_template_detected(native_renderer, native_tokenizer):
    assert native_renderer.native_tools is True
    assert native_renderer.format == "hermes"
    _, _, obs = _game_obs()
    text = native_renderer.render_text(obs.messages, obs.tools)
    assert text.endswith(GEN_PROMPT)
    # the template's own block, not the fallback one; the schema appears exactly once
    assert "To call a tool, write the call exactly" not in text
    assert text.count(json.dumps(CHOOSE_SQUARE_TOOL, ensure_ascii=False)) == 1
    assert text.startswith("<|im_start|>system\n" + obs.messages[0].content + "\n\n# Tools")


def test_native_template_can_be_forced_to_fallback(native_tokenizer):
    r = ChatRenderer(native_tokenizer, tool_prompt="fallback")
    assert r.native_tools is False
    text = r.render_text([Message("user", "hi")], TOOLS)
    assert "To call a tool, write the call exactly" in text


def test_native_tool_prompt_on_template_without_tools_raises(tokenizer):
    with pytest.raises(ChatError, match="ignores tools") as info:
        ChatRenderer(tokenizer, tool_prompt="native", model_name="tiny-random")
    assert "tool_prompt=fallback" in str(info.value)


def test_tokenizer_without_template_raises(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    with pytest.raises(ChatError, match="no chat template"):
        ChatRenderer(tok, model_name="base-model")


def test_explicit_tool_format_wins(tokenizer):
    assert ChatRenderer(tokenizer, tool_format="llama3").format == "llama3"


# ------------------------------------------------------------------ token-in/token-out


@dataclass
class Transcript:
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    spans: list[tuple[int, list[int]]] = field(default_factory=list)  # (offset, completion)
    history: list[Message] = field(default_factory=list)
    tools: list[dict] = field(default_factory=list)
    outcome: str | None = None

    def append(self, ids: list[int], mask: int) -> None:
        self.ids.extend(ids)
        self.mask.extend([mask] * len(ids))


def _play_scripted_game(r: ChatRenderer, eos: bool = True) -> Transcript:
    """A whole game where the 'model' always picks the lowest legal square."""
    tok = r.tokenizer
    env, task, obs = _game_obs()
    t = Transcript(history=list(obs.messages), tools=obs.tools)
    t.append(r.prompt_ids(t.history, t.tools), 0)
    board = "." * 9
    for _ in range(env.max_turns):
        text = _call_text(legal_moves(board)[0])
        completion = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] * eos)
        t.spans.append((len(t.ids), completion))
        t.append(completion, 1)
        message = r.assistant_message(r.decode(completion), t.tools)
        assert message.parse_failure is None, message.parse_detail
        t.history.append(message)
        result = env.step(message)
        board = result.info["board"]
        if result.done:
            t.history.extend(result.messages)
            t.outcome = result.outcome
            break
        t.append(r.continuation_ids(t.history, result.messages, t.tools, completion), 0)
        t.history.extend(result.messages)
    return t


@pytest.mark.parametrize("eos", [True, False], ids=["eos", "no-eos"])
def test_token_in_token_out_whole_game(any_renderer, eos):
    r = any_renderer
    t = _play_scripted_game(r, eos=eos)
    assert t.outcome in ("win", "draw", "loss")
    assert len(t.spans) >= 3  # several assistant turns, each followed by a tool turn

    # (a) completions sit verbatim at their offsets, and only they carry mask 1
    assert len(t.ids) == len(t.mask)
    generated = set()
    for offset, completion in t.spans:
        assert t.ids[offset : offset + len(completion)] == completion
        generated.update(range(offset, offset + len(completion)))
    assert {i for i, m in enumerate(t.mask) if m == 1} == generated

    # (b) the appended sequence is exactly the template's rendering of the conversation
    # (minus the final end marker when the last completion stopped without EOS)
    expected = r.render_text(
        t.history[:-1] if t.history[-1].role == "tool" else t.history,
        t.tools,
        add_generation_prompt=False,
    )
    decoded = r.tokenizer.decode(t.ids)
    if eos:
        assert decoded + "\n" == expected
    else:
        assert decoded + "<|im_end|>\n" == expected
    assert decoded.count("<|im_end|>\n<|im_start|>user\n<tool_response>") == len(t.spans) - 1

    # prefix property: after each continuation, the ids are the next turn's full prompt
    assistant_at = [i for i, m in enumerate(t.history) if m.role == "assistant"]
    assert len(assistant_at) == len(t.spans)
    for (offset, _), cut in zip(t.spans, assistant_at, strict=True):
        prompt_text = r.render_text(t.history[:cut], t.tools, add_generation_prompt=True)
        assert r.tokenizer.decode(t.ids[:offset]) == prompt_text


def test_rendered_history_is_consistent_with_the_last_tool_message(any_renderer):
    """The game's final tool message (not appended as ids) renders after the last call."""
    r = any_renderer
    t = _play_scripted_game(r)
    assert t.history[-1].role == "tool"
    full = r.render_text(t.history, t.tools, add_generation_prompt=False)
    assert full.endswith(
        "<tool_response>\n" + t.history[-1].content + "\n</tool_response><|im_end|>\n"
    )


def test_truncated_completion_gets_the_end_marker(any_renderer):
    r = any_renderer
    tok = r.tokenizer
    _, _, obs = _game_obs()
    history = list(obs.messages)
    prompt = r.prompt_ids(history, obs.tools)
    completion = tok.encode(_call_text(5), add_special_tokens=False)  # stopped without EOS
    message = r.assistant_message(r.decode(completion), obs.tools)
    history.append(message)
    tool_reply = [Message("tool", "You played 5.", name="choose_square")]

    cont = r.continuation_ids(history, tool_reply, obs.tools, completion)
    end_ids = tok.encode("<|im_end|>", add_special_tokens=False)
    assert end_ids == [tok.eos_token_id]
    assert cont[: len(end_ids)] == end_ids
    assert tok.decode(cont).startswith("<|im_end|>\n<|im_start|>user\n")
    full = r.render_text(history + tool_reply, obs.tools)
    assert tok.decode(prompt + completion + cont) == full

    # with EOS, the marker is not repeated: only the rest of it ("\n") follows
    with_eos = completion + [tok.eos_token_id]
    cont_eos = r.continuation_ids(history, tool_reply, obs.tools, with_eos)
    assert cont_eos[0] != tok.eos_token_id
    assert cont_eos == cont[len(end_ids) :]
    assert tok.decode(prompt + with_eos + cont_eos) == full


def test_continuation_needs_an_assistant_turn(renderer):
    with pytest.raises(ChatError, match="ends with the assistant turn"):
        renderer.continuation_ids([Message("user", "hi")], [], TOOLS, [1, 2])


def test_template_rewriting_history_is_rejected(tokenizer):
    tok = copy.deepcopy(tokenizer)
    # drops every assistant message but the last: earlier turns change as the chat grows
    tok.chat_template = (
        "{%- for m in messages -%}"
        "{%- if m.role != 'assistant' or loop.last -%}"
        "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
        "{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    r = ChatRenderer(tok)
    history = [Message("user", "hi"), Message("assistant", "yo")]
    with pytest.raises(ChatError, match="rewrites earlier turns"):
        r.continuation_ids(history, [Message("user", "again")], None, [5, tok.eos_token_id])


# ------------------------------------------------------------------ assistant ids / parsing


def test_assistant_ids_end_with_eos_and_decode_to_call(renderer, tokenizer):
    call = ToolCall("choose_square", {"square": 7})
    ids = renderer.assistant_ids(Message("assistant", tool_calls=[call]))
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[:-1]) == _call_text(7)
    assert tokenizer.eos_token_id not in ids[:-1]


def test_assistant_text_with_content_and_calls(renderer):
    calls = [ToolCall("choose_square", {"square": 1}), ToolCall("choose_square", {"square": 2})]
    text = renderer.assistant_text(Message("assistant", "  I play 1.  ", tool_calls=calls))
    assert text == "I play 1.\n" + _call_text(1) + "\n" + _call_text(2)
    assert renderer.assistant_text(Message("assistant", "plain")) == "plain"


@pytest.mark.parametrize(
    ("text", "failure"),
    [
        (_call_text(4), None),
        ("I pick 4", "no_tool_call"),
        (
            '<tool_call>\n{"name": "choose_square", "arguments": {"square": 4}\n</tool_call>',
            "bad_json",
        ),
        ('<tool_call>\n{"name": "pick", "arguments": {"square": 4}}\n</tool_call>', "unknown_tool"),
        (_call_text(42), "bad_arguments"),
    ],
)
def test_assistant_message_classifies(renderer, text, failure):
    msg = renderer.assistant_message(text, TOOLS)
    assert msg.role == "assistant"
    assert msg.parse_failure == failure
    if failure is None:
        assert msg.tool_calls == [ToolCall("choose_square", {"square": 4})]
        assert renderer.parse(text, TOOLS).calls == msg.tool_calls
    else:
        assert msg.tool_calls == []
        assert msg.parse_detail


def test_assistant_message_without_required_call(renderer):
    msg = renderer.assistant_message("just chatting", TOOLS, require_call=False)
    assert msg.parse_failure is None
    assert msg.content == "just chatting"


def test_decode_skips_special_tokens(renderer, tokenizer):
    ids = tokenizer.encode("hello", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert renderer.decode(ids) == "hello"


def test_gemma_style_turn_ends_both_stop(tokenizer):
    """A tokenizer whose eos is `<end_of_turn>` (as looprl sets Gemma's) still stops on
    `<eos>`, which Gemma's base model may write to end the text; and the other way round."""
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<end_of_turn>", "<eos>"]})
    turn, eos = tok.convert_tokens_to_ids(["<end_of_turn>", "<eos>"])
    tok.eos_token = "<end_of_turn>"
    assert {turn, eos} <= set(ChatRenderer(tok, model_name="gemma-like").eos_ids)
    tok.eos_token = "<eos>"
    assert {turn, eos} <= set(ChatRenderer(tok, model_name="gemma-like").eos_ids)
