"""What makes a run's figures mean less than they seem, said loudly: steps that trained on
nothing, steps whose every episode was cut or unparsable, evals whose episodes hit the
token limit. The console (`looprl run`'s closing lines) and the report show the same
list, from `metrics.jsonl` and the EvalResults.

The health checks of each step (`step_health`) run while the run trains: the loop logs a
check that fires as `health/<check>` 1 in that step's metrics, warns on the console (or,
with `train.health: stop`, stops the run with the sentence), and the report lists each
check with the steps it fired on.
"""

from __future__ import annotations

from typing import Any

TRUNCATED = "truncated"


# the health checks, in the order they are tried; each names what a step showed
HEALTH = {
    "env_errors": "every episode ended in env_error: the environment failed, not the model",
    "unscorable": "every episode was truncated or unparsable: nothing to learn from",
    "equal_groups": "every group's rewards were equal for {patience} steps in a row: no "
    "advantage, so no gradient (harder tasks, a larger group, or algo.dynamic_sampling with "
    "algo.max_oversample > 1)",
    "no_tokens": "no episode had a trainable token: the update had nothing to train on",
    "bad_loss": "NaN or inf in the loss or the gradients: optimizer steps were skipped (a "
    "lower train.lr, or the model's dtype)",
    "flat_loss": "the loss has not changed for {patience} steps in a row while updating: "
    "the update moves nothing (train.lr, or a loss whose tokens are all forced)",
    "zero_grad": "the gradient was exactly 0 while updating: nothing is trained (frozen "
    "parameters, or a loss that does not reach them)",
}


def step_health(
    rows: list[dict[str, Any]], patience: int, groups: int, token_limit: int
) -> dict[str, str]:
    """The checks the newest step (`rows[-1]`, the steps before it for what must last
    `patience` steps) fails: {check: sentence}. `groups`: the groups a step plays
    (`rollout.tasks_per_step`); `token_limit`: `rollout.max_new_tokens`, named when every
    episode was cut."""
    row, last = rows[-1], rows[-patience:]
    out: dict[str, str] = {}
    updating = row.get("train/updates", 0) > 0
    if row.get("rollout/episodes") and row.get("rollout/env_errors") == row["rollout/episodes"]:
        out["env_errors"] = HEALTH["env_errors"]
    elif row.get("rollout/unscorable") == 1.0:
        outcomes = {k[9:]: v for k, v in row.items() if k.startswith("outcomes/")}
        top = max(outcomes, key=outcomes.get) if outcomes else TRUNCATED
        out["unscorable"] = (
            HEALTH["unscorable"]
            + f" (mostly {top})"
            + (
                f"; rollout.max_new_tokens is {token_limit}: raise it (e.g. to {2 * token_limit})"
                if top == TRUNCATED
                else ""
            )
        )
    elif len(last) == patience and all(
        r.get("train/tokens") == 0 and r.get("train/zero_std_groups", 0) >= groups for r in last
    ):
        out["equal_groups"] = HEALTH["equal_groups"].format(patience=patience)
    elif row.get("train/tokens") == 0 and row.get("train/zero_std_groups", 0) < groups:
        out["no_tokens"] = HEALTH["no_tokens"]
    if row.get("train/skipped_steps"):
        out["bad_loss"] = HEALTH["bad_loss"]
    losses = [r.get("train/loss") for r in last if r.get("train/updates", 0) > 0]
    if patience > 1 and len(losses) == patience and len(set(losses)) == 1:
        out["flat_loss"] = HEALTH["flat_loss"].format(patience=patience)
    if updating and row.get("train/grad_norm") == 0.0:
        out["zero_grad"] = HEALTH["zero_grad"]
    return out


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
        out.append(
            f"{len(dead)} of {len(rows)} steps had every episode truncated or unparsable "
            f"(steps {_steps(dead)}): raise rollout.max_new_tokens if they were truncated"
        )
    for check, sentence in HEALTH.items():
        if check == "unscorable":
            continue  # said above, also for runs logged before the health checks
        fired = [r["step"] for r in rows if r.get(f"health/{check}")]
        if fired:
            text = sentence.format(patience="K").split(":")[0]
            out.append(
                f"health check {check} on {len(fired)} of {len(rows)} steps "
                f"(steps {_steps(fired)}): {text}"
            )
    for name, result in evals.items():
        share = ((result or {}).get("outcomes") or {}).get(TRUNCATED, 0.0)
        if share > 0:
            out.append(
                f"{share:.0%} of the {name}'s episodes hit the token limit (outcome "
                "truncated, scored as the environment's lowest reward)"
            )
    return out


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:8])) + (" ..." if len(steps) > 8 else "")


def _updated(row: dict[str, Any]) -> bool:
    """Whether a step made an optimizer update (`train/updates`; a run logged before that
    metric existed: a loss was computed)."""
    if "train/updates" in row:
        return bool(row["train/updates"])
    return "train/loss" not in row or row["train/loss"] is not None
