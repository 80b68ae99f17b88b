"""Constrained decoding for forced tool calls and JSON replies, with xgrammar.

The grammar is the whole assistant reply, then EOS: for a `ToolConstraint`, exactly one
call of an allowed tool, in the model's call syntax, whose arguments satisfy the tool's
JSON schema; for a `JsonConstraint` (`response_format`), one JSON value of the schema
(`engine/json_schema.py` says which schemas), or with tools, that or one call. JSON is
generated without free whitespace (`", "` and `": "` separators, as `json.dumps`
writes them), so the forced reply costs as few tokens as possible.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from looprl.engine import Constraint, JsonConstraint, ToolConstraint
from looprl.errors import ChatError


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function", tool)


def _safe_lengths(schema: Any) -> Any:
    """The schema with every length-limited string (`minLength`/`maxLength`, no
    `pattern`) rewritten as a pattern of plain characters. xgrammar compiles length
    limits into a rule that lets raw control characters through, which is invalid JSON;
    the pattern keeps the limit and excludes them (and quotes and backslashes, so such a
    string cannot hold escapes when a call is forced)."""
    if isinstance(schema, list):
        return [_safe_lengths(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _safe_lengths(value) for key, value in schema.items()}
    limited = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and limited and "pattern" not in out:
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        upper = "" if high is None else str(int(high))
        out["pattern"] = '^[^\\x00-\\x1f"\\\\]{' + f"{low},{upper}" + "}$"
    return out


def call_schema(constraint: ToolConstraint, args_key: str = "arguments") -> dict[str, Any]:
    """JSON schema of one call object {"name": ..., args_key: {...}} of an allowed tool."""
    options = []
    for tool in constraint.tools:
        fn = _function(tool)
        if constraint.tool_choice not in ("required", fn["name"]):
            continue
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": fn["name"]},
                    args_key: _safe_lengths(fn.get("parameters") or {"type": "object"}),
                },
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    if not options:
        raise ChatError(f"tool_choice {constraint.tool_choice!r} names no tool in the schemas")
    return options[0] if len(options) == 1 else {"anyOf": options}


def _literal(text: str) -> str:
    return "root ::= " + json.dumps(text)


def build_grammar(constraint: Constraint) -> Any:
    import xgrammar as xgr

    if isinstance(constraint, JsonConstraint):
        return _json_grammar(constraint)

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
    else:
        raise ChatError(
            f"forced tool calls are not available for the {constraint.fmt!r} call syntax; "
            "use tool_choice=auto or a hermes/llama3/mistral model"
        )
    return xgr.Grammar.concat(*parts)


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
            json.dumps(_safe_lengths(constraint.schema)), any_whitespace=False, strict_mode=True
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
            constraint = ToolConstraint(data["tools"], data["choice"], data["fmt"])
        return self.compiler.compile_grammar(build_grammar(constraint))

    def matcher(self, constraint: Constraint) -> Any:
        import xgrammar as xgr

        # Not sort_keys: the grammar writes arguments in the schema's property order, so
        # two schemas that differ only in that order are two grammars.
        if isinstance(constraint, JsonConstraint):
            data = {"schema": constraint.schema, "tools": constraint.tools}
        else:
            data = {"tools": constraint.tools, "choice": constraint.tool_choice}
        key = json.dumps({**data, "fmt": constraint.fmt})
        return xgr.GrammarMatcher(self._compile(key))
