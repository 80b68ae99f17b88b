"""The grammar of one forced call in the glm (GLM-4.5, Ling) syntax.

A call is written exactly as `chat/formats.py` writes it, which is what
`chat/parsers.py` reads back:

    <tool_call>NAME\\n(<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n)*</tool_call>

The arguments come in the schema's property order: every required one, each optional
one present or not, no others. A VALUE is text, typed by its property's schema as the
parser types it back: a property whose type is (or includes) "string" is raw text
(no `<`, so that neither `</arg_value>` nor another tag can appear inside; `enum` and
`const` become their literals, `minLength`/`maxLength` a bounded repeat, `pattern` its
regular expression); any other property is one compact JSON value of its schema.
"""

from __future__ import annotations

import json
from typing import Any

from looprl.engine.json_schema import relocated, safe_lengths
from looprl.errors import ChatError

# parameters keywords the grammar honours; any other (anyOf at the top, patternProperties,
# ...) could let through a call that the schema rejects, so such a tool is refused
_OBJECT_KEYS = {
    "type",
    "properties",
    "required",
    "additionalProperties",
    "description",
    "title",
    "$defs",
    "definitions",
    "$schema",
    "strict",
}
# where a JSON value's document keeps the tool's parameters, for the references into them
_PARAMETERS = "/$defs/looprl_parameters"


def _literal(text: str) -> Any:
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text))


def _is_text(prop: dict[str, Any]) -> bool:
    """Whether the value is written as raw text: a string type, or (no type) a string
    `const` or an `enum` of strings, which formats.py also writes unquoted."""
    declared = prop.get("type")
    if declared is None:
        choices = prop["enum"] if "enum" in prop else [prop["const"]] if "const" in prop else []
        return bool(choices) and all(isinstance(c, str) for c in choices)
    return declared == "string" or (isinstance(declared, list) and "string" in declared)


def _text_value(prop: dict[str, Any]) -> Any:
    """Raw text satisfying a string property."""
    import xgrammar as xgr

    choices = prop["enum"] if "enum" in prop else [prop["const"]] if "const" in prop else None
    if choices is not None:
        texts = [c if isinstance(c, str) else json.dumps(c) for c in choices]
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(t) for t in texts))
    if "pattern" in prop:
        return xgr.Grammar.from_regex(prop["pattern"].removeprefix("^").removesuffix("$"))
    low, high = int(prop.get("minLength", 0)), prop.get("maxLength")
    if "minLength" in prop or high is not None:
        upper = "" if high is None else str(int(high))
        return xgr.Grammar.from_ebnf(f"root ::= [^<]{{{low},{upper}}}")
    return xgr.Grammar.from_ebnf("root ::= [^<]*")


def _json_value(prop: dict[str, Any], params: dict[str, Any]) -> Any:
    """One compact JSON value of a non-string property. Its `$ref`s point into the tool's
    parameters (`#/$defs/...`, `#`): the value's document holds them under `$defs`, with
    every reference relocated there (`json_schema.relocated`)."""
    import xgrammar as xgr

    own = relocated(safe_lengths(prop), _PARAMETERS)
    inner = relocated(safe_lengths(params), _PARAMETERS)
    schema = {**own, "$defs": {**own.get("$defs", {}), _PARAMETERS.rsplit("/", 1)[1]: inner}}
    return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


def _argument(key: str, prop: Any, params: dict[str, Any]) -> Any:
    import xgrammar as xgr

    prop = prop if isinstance(prop, dict) else {}
    value = _text_value(prop) if _is_text(prop) else _json_value(prop, params)
    return xgr.Grammar.concat(
        _literal(f"<arg_key>{key}</arg_key>\n<arg_value>"), value, _literal("</arg_value>\n")
    )


def _one_tool(fn: dict[str, Any]) -> Any:
    import xgrammar as xgr

    name = fn["name"]
    params = fn.get("parameters") or {"type": "object"}
    unknown = sorted(set(params) - _OBJECT_KEYS)
    if unknown or params.get("type", "object") != "object":
        raise ChatError(
            f"tool {name!r}: a forced call in the glm syntax needs parameters that are one "
            f"object schema with properties; {', '.join(unknown) or 'its type'} cannot be "
            "forced; use tool_choice=auto or simplify the schema"
        )
    required = set(params.get("required") or ())
    parts = [_literal(f"<tool_call>{name}\n")]
    for key, prop in (params.get("properties") or {}).items():
        argument = _argument(key, prop, params)
        parts.append(argument if key in required else xgr.Grammar.union(argument, _literal("")))
    parts.append(_literal("</tool_call>"))
    return xgr.Grammar.concat(*parts)


def glm_call_grammar(functions: list[dict[str, Any]]) -> Any:
    """One call of one of `functions` (OpenAI function schemas) in the glm syntax."""
    import xgrammar as xgr

    grammars = [_one_tool(fn) for fn in functions]
    return grammars[0] if len(grammars) == 1 else xgr.Grammar.union(*grammars)
