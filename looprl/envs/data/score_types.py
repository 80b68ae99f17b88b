"""What a scorer returns (`Score`) and how replies and answers are compared as text: shared
by the rule scorers (`scorers.py`) and the judge (`judge.py`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from looprl.envs.common import reward_label


@dataclass
class Score:
    value: float  # in [0, 1]
    label: str  # correct | partial | wrong
    fields: dict[str, bool] = field(default_factory=dict)  # per-field credit, where it applies


def labelled(value: float, fields: dict[str, bool] | None = None) -> Score:
    return Score(value, reward_label(value), fields or {})


def as_text(value: Any) -> str:
    """A reply or answer as text: strings as they are, anything else as compact JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, ensure_ascii=False)
