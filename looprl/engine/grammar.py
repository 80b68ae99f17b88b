"""Constrained decoding for forced tool calls and JSON replies, with xgrammar.

The grammar is the whole assistant reply, then EOS: for a `ToolConstraint`, exactly one
call of an allowed tool, in the model's call syntax, whose arguments satisfy the tool's
JSON schema; for a `JsonConstraint` (`response_format`), one JSON value of the schema
(`engine/json_schema.py` says which schemas), or with tools, that or one call. JSON is
generated without free whitespace (`", "` and `": "` separators, as `json.dumps`
writes them), so the forced reply costs as few tokens as possible. The glm syntax
(`engine/glm_grammar.py`) writes each argument as text, typed by its schema.

With `Thinking` on, free text comes first (`thinking_grammar`): `<think>TEXT</think>\n`
(tagged) or `TEXT\n` (plain), then the call. The grammar bounds its shape, not its
length: the engine counts its tokens and writes the closing (`thinking_marks`) itself
when the limit is reached.

Which tokens a grammar forced (`is_forced`): a token is forced when it lies inside the
string the grammar allows next (its jump-forward string) or when it is the only token the
grammar allows; every other token is free. The `hf` engine records this for each token
it generates under a grammar (`Completion.free`); loop/decisions.py replays it where
nobody recorded it.

The matcher fills its token bitmask on the host; `apply_bitmask` moves it to the logits'
device and masks them there, so that sampling never copies the logits to the host.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib.util import find_spec
from typing import Any

import numpy as np
import torch

from looprl.engine import Constraint, JsonConstraint, Thinking, ToolConstraint
from looprl.engine.glm_grammar import glm_call_grammar
from looprl.engine.json_schema import relocated, safe_lengths
from looprl.errors import ChatError

# What opens a call in each syntax: plain thinking text may not hold its first character
# (so that the call's start is unambiguous), and a plain text cut short ends with it.
CALL_OPENINGS = {"hermes": "<tool_call>", "glm": "<tool_call>", "llama3": "{", "mistral": "["}
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function", tool)


def call_schema(constraint: ToolConstraint, args_key: str = "arguments") -> dict[str, Any]:
    """JSON schema of one call object {"name": ..., args_key: {...}} of an allowed tool.
    Each tool's parameters are relocated (`json_schema.relocated`) to where they sit in
    the call object, so that their `$ref`s (`#/$defs/...`, `#`) still resolve."""
    functions = _allowed(constraint)
    options = []
    for i, fn in enumerate(functions):
        at = (
            f"/properties/{args_key}"
            if len(functions) == 1
            else f"/anyOf/{i}/properties/{args_key}"
        )
        parameters = safe_lengths(fn.get("parameters") or {"type": "object"})
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, args_key: relocated(parameters, at)},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def _literal(text: str) -> str:
    return "root ::= " + json.dumps(text)


def build_grammar(constraint: Constraint) -> Any:
    import xgrammar as xgr

    if isinstance(constraint, JsonConstraint):
        return _json_grammar(constraint)
    call = _call_grammar(constraint)
    if constraint.thinking.mode == "off":
        return call
    return xgr.Grammar.concat(thinking_grammar(constraint.thinking, constraint.fmt), call)


def thinking_grammar(thinking: Thinking, fmt: str) -> Any:
    """The free text before the call, with its closing. Tagged: `<think>` (unless the
    prompt opened it: `thinking.opened`), then text in
    which `<` is never followed by `/` or `<` (so `</think>` can only be the closing; a
    single `<` may end it), then `</think>\n`. Plain: text without the first character
    of the call's opening, then a newline."""
    import xgrammar as xgr

    if thinking.mode == "tagged":
        body = '([^<] | "<" [^/<])* "<"?'
        opening = "" if thinking.opened else json.dumps(THINK_OPEN)
        ebnf = f"root ::= {opening} {body} {json.dumps(THINK_CLOSE + chr(10))}"
    elif thinking.mode == "plain":
        first = CALL_OPENINGS[fmt][0]
        ebnf = f'root ::= [^{_char_class(first)}]* "\\n"'
    else:
        raise ChatError(f"unknown thinking mode {thinking.mode!r}; use off, tagged or plain")
    return xgr.Grammar.from_ebnf(ebnf)


def _char_class(char: str) -> str:
    """`char` as a member of an EBNF character class."""
    return "\\" + char if char in "[]\\^-" else char


def thinking_marks(thinking: Thinking, fmt: str) -> tuple[str, str]:
    """(end, close): thinking is over once `end` appears in the reply; `close` is the
    text the engine writes to end it when the token limit is reached."""
    if thinking.mode == "tagged":
        return THINK_CLOSE, THINK_CLOSE + "\n"
    first = CALL_OPENINGS[fmt][0]
    return first, "\n" + first


def _call_grammar(constraint: ToolConstraint) -> Any:
    """Exactly one call of an allowed tool in the `fmt` syntax."""
    import xgrammar as xgr

    def schema(key: str) -> Any:
        return xgr.Grammar.from_json_schema(
            json.dumps(call_schema(constraint, key)), any_whitespace=False
        )

    if constraint.fmt == "hermes":
        parts = [
            xgr.Grammar.from_ebnf(_literal("<tool_call>\n")),
            schema("arguments"),
            xgr.Grammar.from_ebnf(_literal("\n</tool_call>")),
        ]
    elif constraint.fmt == "llama3":
        parts = [schema("parameters")]
    elif constraint.fmt == "mistral":
        parts = [
            xgr.Grammar.from_ebnf(_literal("[TOOL_CALLS][")),
            schema("arguments"),
            xgr.Grammar.from_ebnf(_literal("]")),
        ]
    elif constraint.fmt == "glm":
        return glm_call_grammar(_allowed(constraint))
    else:
        raise ChatError(
            f"forced tool calls are not available for the {constraint.fmt!r} call syntax; "
            "use tool_choice=auto or a hermes/llama3/mistral/glm model"
        )
    return xgr.Grammar.concat(*parts)


def _allowed(constraint: ToolConstraint) -> list[dict[str, Any]]:
    """The function schemas `tool_choice` allows."""
    fns = [_function(t) for t in constraint.tools]
    fns = [fn for fn in fns if constraint.tool_choice in ("required", fn["name"])]
    if not fns:
        raise ChatError(f"tool_choice {constraint.tool_choice!r} names no tool in the schemas")
    return fns


def _json_grammar(constraint: JsonConstraint) -> Any:
    """One JSON value of the schema; without a schema, any JSON object (extra properties
    allowed, as `json_object` means); with tools, one call of them as the alternative."""
    import xgrammar as xgr

    if constraint.schema is None:
        grammar = xgr.Grammar.from_json_schema(
            json.dumps({"type": "object"}), any_whitespace=False, strict_mode=False
        )
    else:
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(safe_lengths(constraint.schema)), any_whitespace=False, strict_mode=True
        )
    if not constraint.tools:
        return grammar
    call = build_grammar(ToolConstraint(constraint.tools, "required", constraint.fmt))
    return xgr.Grammar.union(grammar, call)


class GrammarCache:
    """Compiles each distinct constraint once per tokenizer."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self.compiler = xgr.GrammarCompiler(self.info)
        self._compile = lru_cache(maxsize=64)(self._compile_key)

    def _compile_key(self, key: str) -> Any:
        data = json.loads(key)
        constraint: Constraint
        if "schema" in data:
            constraint = JsonConstraint(data["schema"], data["tools"], data["fmt"])
        else:
            # the limit is the engine's, not the grammar's
            thinking = Thinking(data["thinking"], opened=data.get("opened", False))
            constraint = ToolConstraint(data["tools"], data["choice"], data["fmt"], thinking)
        return self.compiler.compile_grammar(build_grammar(constraint))

    def matcher(self, constraint: Constraint) -> Any:
        import xgrammar as xgr

        # Not sort_keys: the grammar writes arguments in the schema's property order, so
        # two schemas that differ only in that order are two grammars.
        if isinstance(constraint, JsonConstraint):
            data = {"schema": constraint.schema, "tools": constraint.tools}
        else:
            data = {
                "tools": constraint.tools,
                "choice": constraint.tool_choice,
                "thinking": constraint.thinking.mode,
                "opened": constraint.thinking.opened,
            }
        key = json.dumps({**data, "fmt": constraint.fmt})
        return xgr.GrammarMatcher(self._compile(key))


def is_forced(matcher: Any, token: int, tokenizer: Any, bitmask_1W: Any) -> bool:
    """Whether the grammar left no choice about `token` at the matcher's current state
    (before it accepts the token): the token's text starts the grammar's jump-forward
    string, or the grammar allows no other token. `bitmask_1W` is scratch space: one row
    of xgrammar's token bitmask, on the CPU."""
    ahead = matcher.find_jump_forward_string()
    if ahead:
        text = tokenizer.decode([token])
        if text and ahead.startswith(text):
            return True
    matcher.fill_next_token_bitmask(bitmask_1W)
    return allows_one_token(bitmask_1W[0])


def allows_one_token(bitmask_W: Any) -> bool:
    """Whether one bitmask row of xgrammar (int32 words, bit i of word w = token 32w + i)
    allows exactly one token: one non-zero word, holding a single set bit."""
    words = bitmask_W.numpy()
    nonzero = np.flatnonzero(words)
    if len(nonzero) != 1:
        return False
    word = int(words[nonzero[0]]) & 0xFFFFFFFF
    return word & (word - 1) == 0


def apply_bitmask(logits_LV: torch.Tensor, mask_NW: torch.Tensor, rows: list[int]) -> None:
    """Mask (to -inf), in place, the tokens that xgrammar's token bitmask `mask_NW` (filled
    on the host, one row per entry of `rows`) forbids in those rows of `logits_LV`, on the
    logits' device: with xgrammar's kernel where it has one for the device (CPU, and CUDA
    where Triton is installed), else `mask_unpacked`."""
    import xgrammar as xgr

    device = logits_LV.device
    mask_NW = mask_NW.to(device, non_blocking=True)
    index = torch.tensor(rows).to(device, non_blocking=True)
    width = min(logits_LV.shape[-1], mask_NW.shape[-1] * 32)
    sub_NV = logits_LV[index]
    if device.type == "cpu" or (device.type == "cuda" and has_triton()):
        xgr.apply_token_bitmask_inplace(sub_NV, mask_NW, vocab_size=width)
    else:
        mask_unpacked(sub_NV, mask_NW, width)
    logits_LV[index] = sub_NV


@lru_cache(maxsize=1)
def has_triton() -> bool:
    """Whether Triton is importable (xgrammar's CUDA kernel needs it): looked up once, not
    at every decode step."""
    return find_spec("triton") is not None


def mask_unpacked(logits_NV: torch.Tensor, mask_NW: torch.Tensor, width: int) -> None:
    """`apply_bitmask` in plain torch ops, for any device: token t < `width` is allowed
    where bit t % 32 of int32 word t // 32 is set (an arithmetic shift of a negative word
    still brings its bit to position 0); the others go to -inf, in place."""
    shifts_32 = torch.arange(32, dtype=torch.int32, device=mask_NW.device)
    allowed_NV = ((mask_NW[:, :, None] >> shifts_32) & 1).flatten(1)[:, :width].bool()
    logits_NV[:, :width] = logits_NV[:, :width].masked_fill(~allowed_NV, float("-inf"))


def jump_forward_tokens(rows: list[Any], tokenizer: Any, pad_id: int) -> list[list[int]] | None:
    """Jump-forward decoding: when the grammar allows only one continuing *string* for
    every live row, append its tokens in one forward pass instead of sampling them one
    by one. The string is tokenized canonically (sampling would pick that tokenization
    almost surely); the recorded logprobs are the policy's, as for sampled tokens.
    `rows`: the batch's rows (engine/sampling.py `Row`). Returns k >= 2 tokens per row
    (pad for finished rows), or None."""
    live = [row for row in rows if not row.done]
    if not live or any(row.matcher is None for row in live):
        return None
    forced: dict[int, list[int]] = {}
    for row in live:
        if row.forced:  # a thinking closing the engine writes
            forced[row.index] = list(row.forced)
            continue
        text = row.matcher.find_jump_forward_string()
        if not text:
            return None
        forced[row.index] = tokenizer.encode(text, add_special_tokens=False)
    k = min(min(len(t) for t in forced.values()), min(r.limit - len(r.ids) for r in live))
    if k < 2:
        return None
    return [forced[r.index][:k] if r.index in forced else [pad_id] * k for r in rows]
