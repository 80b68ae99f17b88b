"""The transcripts of a run folder (`samples/*.jsonl`) read back, and one episode as the
report shows it: the prompt the model was shown, then everything from its first reply on,
each message clipped to MAX_TEXT characters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from looprl.report.stats import fmt

MAX_TEXT = 1500  # characters of one message shown in a transcript


def read_jsonl(path: Path) -> list[dict[str, Any]] | None:
    """A JSONL file's objects; None when it is missing. A line cut short by a crash
    mid-write is skipped."""
    if not path.is_file():
        return None
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def first_by_task(records: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in records:
        out.setdefault(str(r.get("task_id")), r)
    return out


def shown_prompt(record: dict) -> str:
    """What the model was shown before its first reply, less the system prompt."""
    parts = []
    for m in record.get("messages") or []:
        if m.get("role") == "assistant":
            break
        if m.get("role") != "system":
            parts.append(_clip(_text(m.get("content"))))
    return "\n\n".join(parts)


def transcript_side(record: dict) -> tuple[str, list[tuple[str, str]]]:
    """'reward … · outcome', then (role, text) for everything from the first reply on."""
    messages = record.get("messages") or []
    start = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    lines = []
    for m in messages[len(messages) if start is None else start :]:
        text = _text(m.get("content"))
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            args = fn.get("arguments")
            args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            text += f"{chr(10) if text else ''}→ {fn.get('name')}({args})"
        if m.get("parse_failure"):
            text += f"{chr(10) if text else ''}[no valid call: {m['parse_failure']}]"
        lines.append((str(m.get("role")), _clip(text) or "(empty)"))
    if record.get("info"):
        lines.append(("info", _clip(json.dumps(record["info"], ensure_ascii=False))))
    if record.get("error"):
        lines.append(("error", _clip(str(record["error"]))))
    head = f"reward {fmt(record.get('reward'), '+.3f')} · {record.get('outcome')}"
    return head, lines


def _text(content: Any) -> str:
    return content if isinstance(content, str) else "" if content is None else json.dumps(content)


def _clip(text: str) -> str:
    extra = len(text) - MAX_TEXT
    return text if extra <= 0 else f"{text[:MAX_TEXT]}… ({extra} more characters)"
