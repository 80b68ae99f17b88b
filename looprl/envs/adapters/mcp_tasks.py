"""The `mcp` environment's task file: rows read from JSONL, CSV or Parquet
(envs/data/data_files.py), split into train and held-out tasks, and checked row by row
against the server's tools (each problem names the file, the row and the field); read once
per distinct configuration, tool listing and file contents. The row fields are described in
envs/adapters/mcp_env.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema

from looprl.envs.data.data_files import parse_cell
from looprl.envs.data.dataset_rows import (
    check_schema,
    checked_messages,
    split_rows,
    without_held_out,
)
from looprl.envs.data.score_types import as_text
from looprl.envs.data.scorers import Scorer, combine
from looprl.errors import EnvError
from looprl.types import Task

FIELDS = ("prompt", "messages", "system", "answer", "expected_calls", "score_tool", "info")


def answer_score(scorers: list[Scorer], answer: str, expected: Any, row: dict) -> float:
    return combine(scorers, [s(answer, expected, row) for s in scorers])


_CHECKED: dict[str, tuple] = {}  # (train, eval, tools) of each spec, listing and file stamps


def checked_tasks(spec: dict, listing: dict[str, dict], scorers: list[Scorer]) -> tuple:
    """(train tasks, eval tasks, the model's tools), read and checked once per spec,
    server tool listing and file contents."""
    stamps = [
        [p.stat().st_size, p.stat().st_mtime_ns] if p.exists() else None
        for p in (Path(spec["tasks"]), Path(spec["eval_path"] or spec["tasks"]))
    ]
    key = json.dumps([spec, listing, stamps], sort_keys=True, default=str)
    if key not in _CHECKED:
        if len(_CHECKED) >= 8:
            _CHECKED.pop(next(iter(_CHECKED)))
        _CHECKED[key] = _read(spec, listing, scorers)
    return _CHECKED[key]


def _read(spec: dict, listing: dict[str, dict], scorers: list[Scorer]) -> tuple:
    hidden = set(spec["hidden"])
    allow = spec["allow"]
    unknown = sorted(set(allow or ()) - set(listing))
    if unknown:
        raise EnvError(
            f"mcp: tools names {unknown}, which server {spec['server']!r} does not "
            f"have; its tools: {', '.join(listing)}"
        )
    path = Path(spec["tasks"])
    rows, held = split_rows(path, spec)
    hidden |= {str(r[2]["score_tool"]) for r in rows + held if r[2].get("score_tool")}
    shown = {n: t for n, t in listing.items() if n not in hidden and (allow is None or n in allow)}
    if not shown:
        raise EnvError(
            f"mcp: server {spec['server']!r} leaves the model no tools (listed: "
            f"{', '.join(listing) or 'none'}; hidden: "
            f"{', '.join(sorted(hidden))})"
        )
    for name, tool in shown.items():
        check_schema(tool.get("inputSchema") or {}, f"mcp: server tool {name!r}'s input schema")
    tools = [
        {
            "type": "function",
            "function": {
                "name": n,
                **({"description": t["description"]} if t.get("description") else {}),
                "parameters": t.get("inputSchema") or {"type": "object", "properties": {}},
            },
        }
        for n, t in shown.items()
    ]
    evals = [_task("eval", *r, spec, listing, shown, scorers) for r in held]
    train = [_task("train", *r, spec, listing, shown, scorers) for r in rows]
    train = without_held_out(path, train, evals, lambda t: json.dumps(t.data["messages"]))
    return tuple(train), tuple(evals), tools


def _task(
    split: str,
    path: Path,
    number: int,
    row: dict,
    spec: dict,
    listing: dict,
    shown: dict,
    scorers: list[Scorer],
) -> Task:
    """One row as a checked task; every problem names the file, the row and the field."""

    def fail(name: str, what: str) -> EnvError:
        return EnvError(f"{path}: row {number}: field {name!r}: {what}")

    def cell(name: str, expect: Any) -> Any:
        try:
            return parse_cell(row[name], expect)
        except (ValueError, json.JSONDecodeError) as err:
            raise fail(name, str(err)) from None

    unknown = sorted(set(row) - set(FIELDS))
    if unknown:
        raise EnvError(
            f"{path}: row {number}: unknown fields {unknown}; known: {', '.join(FIELDS)}"
        )
    present = {f for f in FIELDS if row.get(f) not in (None, "")}
    if "messages" in present:
        messages = checked_messages(cell("messages", list), fail)
    elif "prompt" in present:
        messages = [{"role": "user", "content": str(row["prompt"])}]
    else:
        raise EnvError(f"{path}: row {number} has neither a 'prompt' nor 'messages'")
    system = cell("system", str) if "system" in present else spec["system_prompt"]
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    data: dict[str, Any] = {"row": number, "messages": messages}
    if "info" in present:
        data["info"] = cell("info", dict)
    if "answer" in present:
        data["answer"] = row["answer"]
    if "expected_calls" in present:
        data["expected_calls"] = [
            _expected_call(c, i, shown, fail) for i, c in enumerate(cell("expected_calls", list))
        ]
    if "score_tool" in present:
        tool = row["score_tool"]
        properties = (listing.get(tool, {}).get("inputSchema") or {}).get("properties") or {}
        if tool not in listing:
            raise fail("score_tool", f"{tool!r} is not a tool of the server ({', '.join(listing)})")
        if not {"answer", "info"} <= set(properties):
            raise fail("score_tool", f"{tool!r} must take the arguments 'answer' and 'info'")
        data["score_tool"] = tool
    if not {"answer", "expected_calls", "score_tool"} & set(data):
        raise EnvError(
            f"{path}: row {number}: nothing to score it by: give it an 'answer', "
            "'expected_calls' or a 'score_tool'"
        )
    task = Task(id=f"{split}-{number}", data=data, seed=number)
    if "answer" in data:  # a scorer that raises on the row's own answer fails here, not later
        local = [s for s in scorers if not s.remote]
        try:
            if local:
                answer_score(local, as_text(data["answer"]), data["answer"], data.get("info", {}))
        except Exception as err:
            raise fail(
                "answer", f"scoring the row's own answer raised {type(err).__name__}: {err}"
            ) from None
    return task


def _expected_call(call: Any, i: int, shown: dict, fail: Any) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise fail("expected_calls", f"call {i} needs a name: {{name, arguments}}")
    if call["name"] not in shown:
        raise fail(
            "expected_calls",
            f"call {i} names {call['name']!r}, not one of the model's tools: {', '.join(shown)}",
        )
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        raise fail("expected_calls", f"call {i}: arguments must be an object")
    schema = shown[call["name"]].get("inputSchema") or {"type": "object"}
    error = next(jsonschema.Draft202012Validator(schema).iter_errors(arguments), None)
    if error is not None:
        where = "/".join(map(str, error.absolute_path)) or "arguments"
        raise fail(
            "expected_calls",
            f"call {i} does not fit {call['name']}'s schema at {where}: {error.message}",
        )
    return {"name": call["name"], "arguments": arguments}
