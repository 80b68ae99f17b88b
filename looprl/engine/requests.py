"""From a chat request to a `GenerationRequest`: the one path the rollout, the agent
proxy and the server share.

`check_tools` validates a request's tools and `tool_choice` and says which tools reach
the prompt; `generation_request` turns prompt ids plus `tool_choice` into the engine's
request, with a forced call ("required" or a tool's name) as a grammar constraint that
is compiled up front, so that a schema the grammar compiler rejects fails this request
alone, not a whole batch.
"""

from __future__ import annotations

from typing import Any

import jsonschema

from looprl.engine import GenerationRequest, ToolConstraint
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


def generation_request(
    prompt_ids: list[int],
    tools: list[dict[str, Any]] | None,
    tool_choice: str,
    fmt: str,
    max_new_tokens: int | None = None,
    engine: Any = None,
) -> GenerationRequest:
    """The engine request for `prompt_ids`: a forced call when `tool_choice` is
    "required" or a tool's name (and there are tools), free text otherwise. With an
    `engine` that compiles grammars, the forced call's grammar is compiled now."""
    constraint = None
    if tools and tool_choice not in ("auto", "none"):
        constraint = ToolConstraint(tools, tool_choice, fmt)
        grammars = getattr(engine, "grammars", None)
        if grammars is not None:
            _compile(grammars, constraint)
    return GenerationRequest(list(prompt_ids), constraint, max_new_tokens)


def _compile(grammars: Any, constraint: ToolConstraint) -> None:
    try:
        grammars().matcher(constraint)
    except ChatError as err:
        raise RequestError(str(err), "tool_choice") from None
    except Exception as err:  # xgrammar rejects some schemas (RuntimeError, ...)
        raise RequestError(
            f"cannot force a call with these tool schemas: {err}; "
            "use tool_choice=auto or simplify the schema",
            "tools",
        ) from None
