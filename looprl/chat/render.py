"""Rendering conversations to token ids with the model's own chat template.

Token-in/token-out: an episode's token sequence is built by *appending*. The first
prompt is the rendered conversation; after each model call the sampled ids are kept
as they are, and only the environment's reply (plus the template's separators and the
next generation prompt) is rendered and tokenized. Generated text is never
re-tokenized, so the trainer scores exactly the tokens the sampler produced.

Tools reach the prompt in one of two ways:
- native: `apply_chat_template(..., tools=...)`, when the template renders tools;
- fallback (e.g. SmolLM2, whose template ignores tools): a block in the system prompt
  lists the tool schemas and shows the call syntax; tool results become user messages
  wrapped in `<tool_response>` tags, assistant calls are written in the call syntax.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cached_property
from typing import Any

from looprl.chat.formats import detect_format, format_tool_call, format_tool_calls
from looprl.chat.parsers import ParseResult, parse_tool_calls
from looprl.errors import ChatError
from looprl.types import Message, ToolCall

# A marker no template alters, used to find where an assistant turn's text ends.
_PLACEHOLDER = "\u2063LOOPRL_ASSISTANT_TURN\u2063"
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "looprl_probe_tool", "description": "probe", "parameters": {}},
}


def fallback_tool_block(tools: list[dict[str, Any]], fmt: str) -> str:
    """The system-prompt text that teaches a template without tool support our tools."""
    schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    example_args = {"<argument>": "<value>"}
    example = format_tool_call(ToolCall(name="<tool name>", arguments=example_args), fmt)
    return (
        "# Tools\n\n"
        "You can call these tools. Their JSON schemas are listed inside <tools></tools>:\n"
        f"<tools>\n{schemas}\n</tools>\n\n"
        "To call a tool, write the call exactly in this form:\n"
        f"{example}"
    )


class ChatRenderer:
    """Renders messages + tools for one tokenizer and parses the model's tool calls."""

    def __init__(
        self,
        tokenizer: Any,
        tool_format: str = "auto",
        tool_prompt: str = "auto",
        model_name: str = "",
    ) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ChatError(
                f"the tokenizer of {model_name or 'this model'} has no chat template; "
                "use an instruct/chat model, or set model.chat_template to a Jinja chat "
                "template or a file holding one"
            )
        self.tokenizer = tokenizer
        template_renders_tools = self._template_renders_tools()
        if tool_prompt == "native" and not template_renders_tools:
            raise ChatError(
                "model.tool_prompt=native, but this chat template ignores tools; "
                "use model.tool_prompt=fallback (or auto)"
            )
        self.native_tools = tool_prompt == "native" or (
            tool_prompt == "auto" and template_renders_tools
        )
        if tool_format != "auto":
            self.format = tool_format
        elif self.native_tools:
            self.format = detect_format(tokenizer.chat_template, model_name)
        else:
            self.format = "hermes"  # the fallback prompt teaches the hermes syntax
        self.eos_ids = self._eos_ids()

    # ------------------------------------------------------------ rendering

    def render_text(
        self,
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The conversation as text, exactly as the template writes it."""
        dicts = self._to_template_dicts(messages, tools)
        try:
            return self.tokenizer.apply_chat_template(
                dicts,
                tools=(tools or None) if self.native_tools else None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as err:  # templates raise jinja errors of many kinds
            raise ChatError(f"the chat template failed to render the conversation: {err}") from err

    @cached_property
    def opens_thinking(self) -> bool:
        """Whether the generation prompt itself opens a `<think>` block (as the templates
        of DeepSeek-R1 distills and Qwen3 thinking models do): a reply then starts inside
        it."""
        text = self.render_text([Message(role="user", content="hi")], None)
        return text.rstrip().endswith("<think>")

    def prompt_ids(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> list[int]:
        """Token ids of the first prompt, ending with the generation prompt."""
        return self.encode(self.render_text(messages, tools))

    def continuation_ids(
        self,
        history: list[Message],
        new_messages: list[Message],
        tools: list[dict[str, Any]] | None,
        completion_ids: list[int],
    ) -> list[int]:
        """Ids to append after the model's last completion so the sequence becomes the
        prompt of the next turn: the rest of the assistant turn's end marker (when the
        model stopped without writing it), the environment's messages, and the next
        generation prompt. `history` ends with that last assistant message."""
        if not history or history[-1].role != "assistant":
            raise ChatError("continuation_ids needs a history that ends with the assistant turn")
        with_placeholder = history[:-1] + [Message(role="assistant", content=_PLACEHOLDER)]
        base = self.render_text(with_placeholder, tools, add_generation_prompt=False)
        full = self.render_text(with_placeholder + new_messages, tools)
        if not full.startswith(base):
            raise ChatError(
                "the chat template rewrites earlier turns when new messages are added, so "
                "token-in/token-out rendering is impossible with it"
            )
        suffix = full[len(base) :]
        end = base[base.rindex(_PLACEHOLDER) + len(_PLACEHOLDER) :]
        return self.encode(self._missing_end(end, completion_ids) + suffix)

    def assistant_ids(self, message: Message) -> list[int]:
        """Ids of an assistant message as the model would write it, ending with EOS
        (used for demonstrations)."""
        return self.encode(self.assistant_text(message)) + self.eos_ids[:1]

    def assistant_text(self, message: Message) -> str:
        """An assistant message's content followed by its calls in the model's syntax."""
        calls = format_tool_calls(message.tool_calls, self.format) if message.tool_calls else ""
        return "\n".join(part for part in (message.content.strip(), calls) if part)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids (special tokens kept out; invalid bytes replaced)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------ parsing

    def parse(
        self, text: str, tools: list[dict[str, Any]], require_call: bool = True
    ) -> ParseResult:
        return parse_tool_calls(text, tools, self.format, require_call=require_call)

    def assistant_message(
        self, text: str, tools: list[dict[str, Any]] | None, require_call: bool = True
    ) -> Message:
        """Parse model text into an assistant `Message` (calls or a classified failure)."""
        return self.assistant_reply(text, tools, require_call)[0]

    def assistant_reply(
        self,
        text: str,
        tools: list[dict[str, Any]] | None,
        require_call: bool = True,
        call_id: Callable[[int, ToolCall], str] | None = None,
    ) -> tuple[Message, str | None]:
        """The assistant `Message` a completion's text stands for, and its <think> text.

        With `tools` (a list, even empty) the text is parsed: calls, or a classified
        failure (a missing call is one when `require_call`); call j gets the id
        `call_id(j, call)` when given. `tools=None` means plain chat: the text is the
        content as it is, nothing is parsed."""
        if tools is None:
            return Message(role="assistant", content=text), None
        result = self.parse(text, tools, require_call=require_call)
        if call_id is not None:
            for j, call in enumerate(result.calls):
                call.id = call_id(j, call)
        message = Message(
            role="assistant",
            content=result.content,
            tool_calls=result.calls,
            parse_failure=result.failure,
            parse_detail=result.detail,
        )
        return message, result.reasoning

    # ------------------------------------------------------------ internals

    def _to_template_dicts(
        self, messages: list[Message], tools: list[dict[str, Any]] | None
    ) -> list[dict[str, Any]]:
        if self.native_tools or not tools:
            return [self._native_dict(m) for m in messages]
        out: list[dict[str, Any]] = []
        block = fallback_tool_block(tools, self.format)
        for m in messages:
            if m.role == "tool":
                out.append(
                    {"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"}
                )
            elif m.role == "assistant":
                text = m.content if m.content == _PLACEHOLDER else self.assistant_text(m)
                out.append({"role": "assistant", "content": text})
            else:
                out.append({"role": m.role, "content": m.content})
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
        return out

    @staticmethod
    def _native_dict(m: Message) -> dict[str, Any]:
        d = m.to_dict()
        if m.role == "tool" and "name" not in d:
            d["name"] = "tool"
        return d

    def _template_renders_tools(self) -> bool:
        msgs = [{"role": "user", "content": "hello"}]
        try:
            plain = self.tokenizer.apply_chat_template(msgs, tokenize=False)
            with_tool = self.tokenizer.apply_chat_template(
                msgs, tools=[_PROBE_TOOL], tokenize=False
            )
        except Exception:
            return False
        return plain != with_tool and "looprl_probe_tool" in with_tool

    def _eos_ids(self) -> list[int]:
        ids = []
        # the tokenizer's own, then the turn ends of known templates; Gemma's turn ends with
        # <end_of_turn>, and its base model may also end the text with <eos>
        ends = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<eos>")
        for token in (self.tokenizer.eos_token, *ends):
            if token is None:
                continue
            tid = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id and tid not in ids:
                ids.append(tid)
        if not ids:
            raise ChatError("the tokenizer has no end-of-sequence token")
        return ids

    def _missing_end(self, end: str, completion_ids: list[int]) -> str:
        """The part of the assistant end marker the model did not write itself."""
        if completion_ids and completion_ids[-1] in self.eos_ids:
            eos_text = self.tokenizer.convert_ids_to_tokens(completion_ids[-1])
            if end.startswith(eos_text):
                return end[len(eos_text) :]
        return end
