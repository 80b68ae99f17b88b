"""What makes a run's figures mean less than they seem, said loudly: steps that trained on
nothing, steps whose every episode was cut or unparsable, evals whose episodes hit the
token limit. The console (`looprl run`'s closing lines) and the report show the same
list, from `metrics.jsonl` and the EvalResults."""

from __future__ import annotations

from typing import Any

TRUNCATED = "truncated"


def run_warnings(rows: list[dict[str, Any]], evals: dict[str, dict | None]) -> list[str]:
    """One sentence per problem found in the steps (`rows`) and the named evals."""
    out = []
    if rows and not any(_updated(r) for r in rows):
        out.append(
            f"the run trained on nothing: none of its {len(rows)} steps updated the policy "
            "(train/updates is 0 on every step: every group's rewards were equal, or every "
            "episode was truncated before it wrote a token, or an env_error)"
        )
    dead = [r["step"] for r in rows if r.get("rollout/unscorable") == 1.0]
    if dead:
        shown = ", ".join(map(str, dead[:8])) + (" ..." if len(dead) > 8 else "")
        out.append(
            f"{len(dead)} of {len(rows)} steps had every episode truncated or unparsable "
            f"(steps {shown}): raise rollout.max_new_tokens if they were truncated"
        )
    for name, result in evals.items():
        share = ((result or {}).get("outcomes") or {}).get(TRUNCATED, 0.0)
        if share > 0:
            out.append(
                f"{share:.0%} of the {name}'s episodes hit the token limit (outcome "
                "truncated, scored as the environment's lowest reward)"
            )
    return out


def _updated(row: dict[str, Any]) -> bool:
    """Whether a step made an optimizer update (`train/updates`; a run logged before that
    metric existed: a loss was computed)."""
    if "train/updates" in row:
        return bool(row["train/updates"])
    return "train/loss" not in row or row["train/loss"] is not None
