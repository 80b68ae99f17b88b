"""The `dataset` env's rows: read from the data files once per distinct configuration and
file contents, split into train and held-out tasks, and checked row by row (each problem
names the file, the row and the field). `env` is the `Dataset` being built: its form,
schema, scorers, `response` and `score` check each row's own answer."""

from __future__ import annotations

import difflib
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

from looprl.envs.data.data_files import parse_cell, read_rows
from looprl.errors import EnvError
from looprl.types import Task

COLUMNS = ("prompt", "messages", "system", "answer", "tools", "info")
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Rows:
    """The checked rows of both splits (built once per distinct env.args)."""

    train: tuple[Task, ...]
    eval: tuple[Task, ...]
    dropped: int  # train rows left out because their prompt is also a held-out one


_CHECKED: dict[str, Rows] = {}  # the checked rows of each distinct spec and file stamps


def _stamps(*paths: str | None) -> list[Any]:
    """Each file's size and modification time: a file changed on disk is read again."""
    out: list[Any] = []
    for p in paths:
        stat = Path(p).stat() if p and Path(p).exists() else None
        out.append(None if stat is None else [stat.st_size, stat.st_mtime_ns])
    return out


def checked_messages(messages: list, fail: Any) -> list[dict[str, str]]:
    """A row's chat as {role, content} dicts; `fail(field, what)` makes the error that names
    the file and the row."""
    for i, m in enumerate(messages):
        if not (
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
        ):
            raise fail("messages", f"message {i} needs a role in {ROLES} and text content")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


@dataclass(frozen=True)
class Splits:
    """Which split of a saved DatasetDict or a hub dataset each side reads (and a hub
    dataset's revision and subset); a plain file has one table and ignores them."""

    split: str = "train"
    eval_split: str | None = None  # of eval_path, else of path; None: eval_path's `split`
    revision: str | None = None
    subset: str | None = None

    def rows(self, path: Path, split: str) -> list[tuple[Path, int, dict]]:
        return [(path, n, row) for n, row in read_rows(path, split, self.revision, self.subset)]


def split_rows(
    path: Path,
    spec: dict,
    splits: Splits = Splits(),  # noqa: B008 (frozen)
) -> tuple[list[tuple], list[tuple]]:
    """The (file, row number, row) triples of the train and held-out splits: `path` and
    `spec["eval_path"]`, the `eval_split` of `path`, or a seeded `spec["eval_fraction"]`
    of `path` held out."""
    rows = splits.rows(path, splits.split)
    if spec["eval_path"]:
        return rows, splits.rows(Path(spec["eval_path"]), splits.eval_split or splits.split)
    if splits.eval_split is not None:
        return rows, splits.rows(path, splits.eval_split)
    order = list(range(len(rows)))
    random.Random(spec["split_seed"]).shuffle(order)
    k = max(1, round(spec["eval_fraction"] * len(rows)))
    if k >= len(rows):
        raise EnvError(
            f"{path}: {len(rows)} rows leave none for training at eval_fraction "
            f"{spec['eval_fraction']}; add rows or pass eval_path"
        )
    held = set(order[:k])
    return (
        [r for i, r in enumerate(rows) if i not in held],
        [r for i, r in enumerate(rows) if i in held],
    )


def _rows(spec: dict, env: Any) -> Rows:
    """Read and check both splits (`env` gives the scorers, form and schema); say what was
    dropped or repeated."""
    columns = {name: spec["columns"].get(name, name) for name in COLUMNS}
    eval_map = spec["eval_columns"] if spec["eval_columns"] is not None else spec["columns"]
    eval_columns = {name: eval_map.get(name, name) for name in COLUMNS}
    path = Path(spec["path"])
    splits = Splits(spec["split"], spec["eval_split"], spec["revision"], spec["subset"])
    rows, eval_rows = split_rows(path, spec, splits)
    if spec["eval_path"]:  # two files, each with its own map
        check_columns(rows, columns, spec["columns"], env, "columns")
        check_columns(eval_rows, eval_columns, eval_map, env, "eval_columns")
    else:
        check_columns(rows + eval_rows, columns, spec["columns"], env, "columns")
    held_out = [_task("eval", *r, eval_columns, spec, env) for r in eval_rows]
    train = [_task("train", *r, columns, spec, env) for r in rows]
    kept = without_held_out(path, train, held_out, _prompt_key)
    check_field_match(env.scorers, train + held_out, spec["form"])
    for note in notes(path, train, kept):
        print(f"warning: {note}", file=sys.stderr)
    return Rows(tuple(kept), tuple(held_out), len(train) - len(kept))


def notes(path: Path, train: list[Task], kept: list[Task]) -> list[str]:
    """What the user should know of the train rows: those dropped for a held-out twin,
    and prompts asked more than once (kept: each copy is drawn as often as any row)."""
    out = []
    if len(kept) < len(train):
        out.append(
            f"{path}: {len(train) - len(kept)} train row(s) dropped: their prompt is also a "
            "held-out row's (the splits never share a task)"
        )
    answers: dict[str, list[Any]] = {}
    for task in kept:
        answers.setdefault(_prompt_key(task), []).append(task.data.get("answer"))
    repeats = sum(len(a) - 1 for a in answers.values())
    if repeats:
        differ = sum(1 for a in answers.values() if any(x != a[0] for x in a))
        clash = f"; {differ} such prompt(s) with different answers" if differ else ""
        out.append(
            f"{path}: {repeats} train row(s) repeat an earlier row's prompt (kept: such a "
            f"prompt is drawn once per copy{clash})"
        )
    return out


def check_field_match(scorers: list[Any], tasks: list[Task], form: str) -> None:
    """A `field_match` entry naming a field that no row's answer has (a typo would leave the
    field matched the default way, unsaid) is an EnvError with a suggestion."""
    fields: set[str] = set()
    for task in tasks:
        answer = task.data.get("answer")
        if form == "tool_call" and isinstance(answer, dict):
            answer = answer["arguments"]
        fields |= set(answer) if isinstance(answer, dict) else set()
    for scorer in scorers:
        named = dict(scorer.matching.fields) if scorer.matching is not None else {}
        for name in sorted(set(named) - fields):
            close = difflib.get_close_matches(name, sorted(fields), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise EnvError(
                f"scorers ({scorer.name}): field_match names {name!r}, a field no row's answer "
                f"has; {hint}the answers' fields: {', '.join(sorted(fields)) or 'none'}"
            )


def check_columns(
    rows: list[tuple], columns: dict[str, str], mapped: dict[str, str], env: Any, key: str
) -> None:
    """A column that no row of a file has is one error naming the file's columns (not the
    first row's): no prompt or messages, the answer a scorer needs, or a column `key` maps."""
    by_file: dict[Path, set[str]] = {}
    for path, _, row in rows:
        by_file.setdefault(path, set()).update(k for k, v in row.items() if v not in (None, ""))
    needing = [s.name for s in env.scorers if s.needs_answer]
    for path, have in by_file.items():
        listed = ", ".join(sorted(have)) or "none"

        def missing(what: str, path: Path = path, listed: str = listed) -> EnvError:
            return EnvError(
                f"{path}: {what} is missing from every row; the file's columns: {listed} "
                f"(env.args.{key} maps looprl's names to yours, e.g. {{prompt: question}})"
            )

        for name, column in mapped.items():
            if column not in have:
                raise missing(f"column {column!r} ({key} maps {name} to it)")
        if columns["prompt"] not in have and columns["messages"] not in have:
            raise missing(f"a {columns['prompt']!r} or {columns['messages']!r} column")
        if needing and columns["answer"] not in have:
            raise missing(f"column {columns['answer']!r} (the scorer {needing[0]!r} needs it)")


def without_held_out(
    path: Path, train: list[Task], held_out: list[Task], prompt: Callable[[Task], str]
) -> list[Task]:
    """The train tasks whose prompt is not also a held-out task's (so the splits never
    overlap); an EnvError when none is left."""
    seen = {prompt(t) for t in held_out}
    kept = [t for t in train if prompt(t) not in seen]
    if not kept:
        raise EnvError(f"{path}: every train row's prompt is also a held-out one")
    return kept


def _prompt_key(task: Task) -> str:
    return json.dumps([task.data["messages"], task.data.get("tools")], sort_keys=True)


def _task(
    split: str, path: Path, number: int, row: dict, columns: dict, spec: dict, env: Any
) -> Task:
    """One row as a checked task; every problem names the file, the row and the field."""

    def fail(field: str, what: str) -> EnvError:
        return EnvError(f"{path}: row {number}: field {columns[field]!r}: {what}")

    def cell(field: str, expect: Any) -> Any:
        try:
            return parse_cell(row[columns[field]], expect)
        except (ValueError, json.JSONDecodeError) as err:
            raise fail(field, str(err)) from None

    present = {f for f in COLUMNS if row.get(columns[f]) not in (None, "")}
    if "messages" in present:
        messages = checked_messages(cell("messages", list), fail)
    elif "prompt" in present:
        messages = [{"role": "user", "content": str(row[columns["prompt"]])}]
    else:
        raise EnvError(
            f"{path}: row {number} has neither a {columns['prompt']!r} nor a "
            f"{columns['messages']!r} column (set env.args.columns to map yours; "
            f"the row's columns: {', '.join(row) or 'none'})"
        )
    system = cell("system", str) if "system" in present else spec["system_prompt"]
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    data: dict[str, Any] = {"row": number, "messages": messages}
    if "info" in present:
        data["info"] = cell("info", dict)
    if spec["form"] == "tool_call":
        tools = cell("tools", list) if "tools" in present else spec["tools"]
        if not tools:
            raise fail("tools", "answer_form tool_call needs tools (a column or env.args.tools)")
        try:
            check_tools(tools, "tools")
        except EnvError as err:
            raise fail("tools", str(err)) from None
        data["tools"] = tools
    if "answer" in present:
        data["answer"] = _answer(row[columns["answer"]], data, spec, fail, env)
    elif needing := [s.name for s in env.scorers if s.needs_answer]:
        raise fail("answer", f"missing, and the scorer {needing[0]!r} needs it")
    task = Task(id=f"{split}-{number}", data=data, seed=number)
    if "answer" in data:  # a scorer that raises on the row's own answer fails here, not later
        response = env.response(env.demonstrations(task)[0], task)[0]
        local = [s for s in env.scorers if not s.remote]  # a judge is not asked per row here
        try:
            if local:
                env.score(response, task, local)
        except Exception as err:
            raise fail(
                "answer", f"scoring the row's own answer raised {type(err).__name__}: {err}"
            ) from None
    return task


def _answer(value: Any, data: dict, spec: dict, fail: Any, env: Any) -> Any:
    """The answer in its form: a checked call, a checked JSON value, or text as given."""
    form = spec["form"]
    if form == "text":
        return value
    try:
        value = parse_cell(value, (dict, list) if form == "json" else dict)
    except (ValueError, json.JSONDecodeError) as err:
        raise fail("answer", str(err)) from None
    if form == "json":
        if env.response_schema is not None and not valid(value, env.response_schema):
            raise fail("answer", "does not satisfy response_schema")
        return value
    tools = {t.get("function", t)["name"]: t.get("function", t) for t in data["tools"]}
    if "name" in value and "arguments" in value:
        name, arguments = value["name"], value["arguments"]
    elif len(tools) == 1:
        name, arguments = next(iter(tools)), value
    else:
        raise fail("answer", "with several tools, the answer is {name, arguments}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise fail("answer", f"arguments are not JSON: {err.msg}") from None
    if name not in tools:
        raise fail("answer", f"calls {name!r}, which is not one of the tools: {', '.join(tools)}")
    if not isinstance(arguments, dict):
        raise fail("answer", "the call's arguments must be an object")
    schema = tools[name].get("parameters") or {"type": "object"}
    order = list(schema.get("properties") or {})  # the order a forced call writes them in
    arguments = {**{k: arguments[k] for k in order if k in arguments}, **arguments}
    error = next(jsonschema.Draft202012Validator(schema).iter_errors(arguments), None)
    if error is not None:
        where = "/".join(map(str, error.absolute_path)) or "arguments"
        raise fail("answer", f"the call does not fit {name}'s schema at {where}: {error.message}")
    return {"name": name, "arguments": arguments}


def check_tools(tools: Any, where: str) -> None:
    if not isinstance(tools, list) or not tools:
        raise EnvError(f"{where}: expected a non-empty list of tool schemas")
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise EnvError(f"{where}[{i}]: a tool needs a function name")
        check_schema(fn.get("parameters") or {"type": "object"}, f"{where}[{i}] ({fn['name']})")


def check_schema(schema: Any, where: str) -> None:
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except Exception as err:
        detail = getattr(err, "message", str(err))
        raise EnvError(f"{where} is not a valid JSON schema: {detail}") from None


def valid(value: Any, schema: dict) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def checked_rows(spec: dict, env: Any) -> Rows:
    """The rows of `spec`, read and checked once per distinct spec and file contents."""
    key = json.dumps([spec, _stamps(spec["path"], spec["eval_path"])], sort_keys=True, default=str)
    if key not in _CHECKED:
        if len(_CHECKED) >= 8:
            _CHECKED.pop(next(iter(_CHECKED)))
        _CHECKED[key] = _rows(spec, env)
    return _CHECKED[key]
