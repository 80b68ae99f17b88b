"""From a chat request to a `GenerationRequest`: the one path the rollout, the agent
proxy and the server share.

`check_tools` validates a request's tools and `tool_choice` and says which tools reach
the prompt; `generation_request` turns prompt ids plus `tool_choice` (and an OpenAI
`response_format`) into the engine's request, with a forced call ("required" or a tool's
name) or a JSON reply as a grammar constraint that is compiled up front, so that a
schema the grammar compiler rejects fails this request alone, not a whole batch.
"""

from __future__ import annotations

import re
from typing import Any

import jsonschema

from looprl.engine import Constraint, GenerationRequest, JsonConstraint, Thinking, ToolConstraint
from looprl.engine.json_schema import unsupported_features
from looprl.errors import ChatError, RequestError


def tool_name(tool: dict[str, Any]) -> str | None:
    """The name of an OpenAI function-format (or bare) tool schema."""
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    return name if isinstance(name, str) else None


def check_tools(tools: list[dict] | None, tool_choice: str) -> list[dict] | None:
    """Validate `tools` (names, unique, parameters a JSON schema) and `tool_choice`;
    return the tools to render: None without tools or with tool_choice "none"."""
    names: list[str] = []
    for i, tool in enumerate(tools or []):
        name = tool_name(tool)
        if not name:
            raise RequestError(f"tools[{i}] has no function name", f"tools[{i}]")
        if name in names:
            raise RequestError(f"two tools are called {name!r}", f"tools[{i}].function.name")
        names.append(name)
        params = tool.get("function", tool).get("parameters")
        if params is not None:
            try:
                jsonschema.validators.validator_for(params).check_schema(params)
            except Exception as err:
                detail = getattr(err, "message", str(err))
                raise RequestError(
                    f"tools[{i}] ({name}): parameters is not a valid JSON schema: {detail}",
                    f"tools[{i}].function.parameters",
                ) from None
    if not isinstance(tool_choice, str):
        raise RequestError("tool_choice must be a string", "tool_choice")
    if tool_choice not in ("auto", "none"):
        if not names:
            raise RequestError(f"tool_choice={tool_choice!r} needs tools", "tool_choice")
        if tool_choice != "required" and tool_choice not in names:
            raise RequestError(
                f"tool_choice names {tool_choice!r}, which is not one of the tools: "
                f"{', '.join(names)}",
                "tool_choice",
            )
    return None if tool_choice == "none" else (list(tools or []) or None)


def json_constraint(
    response_format: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None,
    tool_choice: str,
    fmt: str,
) -> JsonConstraint | None:
    """The JSON constraint an OpenAI `response_format` asks for (None for "text" or
    none): `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"name",
    "schema", "strict"}}`. `tools` are those `check_tools` returned: with tool_choice
    "auto" the reply may be a call of one of them instead of the JSON. With a forced call
    (tool_choice "required" or a tool's name) the call wins, as in the OpenAI API: the
    format applies to a text reply, and this turn's reply is the call, so the format is
    checked and None returned."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise RequestError("response_format must be an object with a 'type'", "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise RequestError(
            f"response_format.type is {kind!r}; use text, json_object or json_schema",
            "response_format.type",
        )
    schema = None
    if kind == "json_schema":
        schema = _response_schema(response_format.get("json_schema"))
    if tools and tool_choice not in ("auto", "none"):
        return None  # the forced call is the reply (generation_request builds it)
    return JsonConstraint(schema, tools if tool_choice == "auto" else None, fmt)


def _response_schema(spec: Any) -> dict[str, Any]:
    where = "response_format.json_schema"
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise RequestError(f"{where} must be an object with a 'name' and a 'schema'", where)
    schema = spec.get("schema", {"type": "object", "additionalProperties": True})
    if not isinstance(schema, dict):
        raise RequestError(f"{where}.schema must be a JSON schema object", f"{where}.schema")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except Exception as err:
        detail = getattr(err, "message", str(err))
        raise RequestError(
            f"{where}.schema is not a valid JSON schema: {detail}", f"{where}.schema"
        ) from None
    problems = unsupported_features(schema)
    if problems:
        raise RequestError(
            f"{where}.schema uses what a reply cannot be forced to satisfy: " + "; ".join(problems),
            f"{where}.schema",
        )
    return schema


def generation_request(
    prompt_ids: list[int],
    tools: list[dict[str, Any]] | None,
    tool_choice: str,
    fmt: str,
    max_new_tokens: int | None = None,
    engine: Any = None,
    response_format: dict[str, Any] | None = None,
    thinking: Thinking | None = None,
) -> GenerationRequest:
    """The engine request for `prompt_ids`: a forced call when `tool_choice` is
    "required" or a tool's name (and there are tools), after free text as `thinking`
    allows, a JSON reply when `response_format` asks for one, free text otherwise. With
    an `engine` that compiles grammars, the constraint's grammar is compiled now."""
    constraint: Constraint | None = json_constraint(response_format, tools, tool_choice, fmt)
    if constraint is None and tools and tool_choice not in ("auto", "none"):
        constraint = ToolConstraint(tools, tool_choice, fmt, thinking or Thinking())
    grammars = getattr(engine, "grammars", None)
    if constraint is not None and grammars is not None:
        _compile(grammars, constraint)
    return GenerationRequest(list(prompt_ids), constraint, max_new_tokens)


def _compile(grammars: Any, constraint: Constraint) -> None:
    json_reply = isinstance(constraint, JsonConstraint)
    try:
        grammars().matcher(constraint)
    except ChatError as err:
        raise RequestError(str(err), "response_format" if json_reply else "tool_choice") from None
    except Exception as err:  # xgrammar rejects some schemas (RuntimeError, ...)
        detail = _XGRAMMAR_PREFIX.sub("", str(err).strip())
        if json_reply:
            raise RequestError(
                f"cannot force a reply of this response_format schema: {detail}",
                "response_format",
            ) from None
        raise RequestError(
            f"cannot force a call with these tool schemas: {detail}; "
            "use tool_choice=auto or simplify the schema",
            "tools",
        ) from None


# xgrammar's messages start with a time and a C++ source location: of no use to a client
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
