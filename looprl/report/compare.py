"""`looprl compare RUN_A RUN_B ...`: runs that played the same held-out episodes, each
paired against the first one: `compare.md`, a self-contained `compare.html` and
`plots/*.png` in one folder.

Runs are comparable only when their baseline evals played the same episodes: the same
task ids in the same order, the same task seed and eval temperature, the same env. Then
the finals are paired episode by episode (the bootstrap of `stats.paired_difference`
resamples whole tasks), whatever else differs between the runs: the model, the algorithm,
the learning rate. Runs that did not play the same episodes are refused with the reason,
and nothing is written.

The run folders are read into `Run`s by `compare_read.py`; the overlaid curves are drawn
by `compare_plots.py`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from looprl.errors import ConfigError
from looprl.report.compare_failures import compare_failures
from looprl.report.compare_plots import plot_blocks
from looprl.report.compare_read import Run, load_run, name_runs, paired_evals
from looprl.report.plots import finite, render_html, render_markdown
from looprl.report.stats import Paired, paired_stats, reward_with_ci

# ============================================================================ the check


def episode_difference(first: dict, other: dict) -> str | None:
    """How two baseline evals differ in the episodes they played; None when they match."""
    if first.get("env") != other.get("env"):
        return f"a different env ({other.get('env')} instead of {first.get('env')})"
    ids, other_ids = first.get("task_ids"), other.get("task_ids")
    if ids is None or other_ids is None:
        return "no per-episode task ids in eval/baseline.json (written by an older looprl)"
    if len(ids) != len(other_ids):
        return f"a different number of episodes ({len(other_ids)} instead of {len(ids)})"
    if first.get("task_seed") != other.get("task_seed"):
        return (
            f"a different eval seed (task seed {other.get('task_seed')} instead of "
            f"{first.get('task_seed')})"
        )
    if ids != other_ids:
        moved = sum(a != b for a, b in zip(ids, other_ids))
        return f"different task ids ({moved} of {len(ids)} episodes play another task)"
    if finite(first.get("temperature")) != finite(other.get("temperature")):
        return (
            f"a different eval temperature ({other.get('temperature')} instead of "
            f"{first.get('temperature')})"
        )
    return None


def check_same_episodes(runs: list[Run]) -> list[str]:
    """Raise when a run's baseline did not play the first run's held-out episodes; return
    the notes worth a line (baselines with the same episodes but other rewards)."""
    first = runs[0]
    problems = []
    for run in runs[1:]:
        why = episode_difference(first.evals["baseline"], run.evals["baseline"])
        if why is not None:
            problems.append(f"{run.path} played {why} in its baseline eval")
    if problems:
        raise ConfigError(
            f"these runs did not play the same held-out episodes as {first.path}, so they "
            "cannot be paired: " + "; ".join(problems) + ". Compare runs made with the same "
            "env, eval.tasks, eval.samples_per_task, eval.seed and eval.temperature."
        )
    rewards = first.evals["baseline"].get("rewards")
    differ = [run.name for run in runs[1:] if run.evals["baseline"].get("rewards") != rewards]
    if not differ:
        return []
    return [
        f"The baselines' rewards differ ({', '.join(differ)} against {first.name}) although "
        "the episodes match: different models or sampling settings (see the config "
        "differences). The finals are still paired episode by episode, but each run "
        "started from its own baseline."
    ]


# ============================================================================ the tables


def config_rows(runs: list[Run]) -> list[list[str]]:
    """One row per dotted config key whose value differs between the runs."""
    keys = dict.fromkeys(key for run in runs for key in run.settings)
    rows = []
    for key in keys:
        values = [_setting(run.settings, key) for run in runs]
        if len(set(values)) > 1:
            rows.append([key, *values])
    return rows


def _setting(settings: dict[str, Any], key: str) -> str:
    if key not in settings:
        return "(absent)"
    value = settings[key]
    return value if isinstance(value, str) else json.dumps(value)


def paired_rows(runs: list[Run]) -> list[list[str]]:
    """Per paired eval that any run has: the first run's mean [CI], then each other run's
    mean [CI] and its paired difference to the first run over the same episodes."""
    first = runs[0]
    rows = []
    for key, label in paired_evals(runs):
        if not any(key in run.evals for run in runs):
            continue
        reference = first.evals.get(key)
        for run in runs:
            result = run.evals.get(key)
            if result is None:
                rows.append([label, run.name, "-", f"no eval/{key}.json", "-", "-"])
            elif run is first:
                rows.append(
                    [label, run.name, _episodes(result), reward_with_ci(result), "(reference)", "-"]
                )
            else:
                paired = (
                    paired_stats(reference, result)
                    if reference is not None
                    else f"{first.name} has no eval/{key}.json"
                )
                rows.append(
                    [
                        label,
                        run.name,
                        _episodes(result),
                        reward_with_ci(result),
                        *_difference(paired),
                    ]
                )
    return rows


def _episodes(result: dict) -> str:
    return str(result.get("n", len(result.get("rewards") or [])))


def _difference(paired: Paired | str) -> list[str]:
    if isinstance(paired, str):  # paired_stats speaks of one run's baseline and final
        return [f"not paired: {paired.replace('baseline and final', 'the two runs')}", "-"]
    return [
        f"{paired.mean:+.3f} [{paired.lo:+.3f}, {paired.hi:+.3f}]",
        f"{paired.better} / {paired.same} / {paired.worse}",
    ]


def outcome_shares(result: dict) -> dict[str, float]:
    """The share of each `episode_outcomes` label among the eval's episodes."""
    labels = list(result.get("episode_outcomes") or [])
    return {label: count / len(labels) for label, count in Counter(labels).items()}


def outcome_rows(runs: list[Run], key: str = "final") -> list[list[str]]:
    """Per outcome label: each run's share in its `key` eval and, for the other runs, the
    difference to the first run's share (in percentage points)."""
    shares = [outcome_shares(run.evals[key]) for run in runs]
    labels = sorted({label for side in shares for label in side})
    rows = []
    for label in labels:
        base = shares[0].get(label, 0.0)
        cells = [f"{base:.0%}"]
        for side in shares[1:]:
            share = side.get(label, 0.0)
            cells.append(f"{share:.0%} ({100 * (share - base):+.0f} pp)")
        rows.append([label, *cells])
    return rows


def header_rows(runs: list[Run]) -> list[list[str]]:
    return [
        [
            run.name,
            str(run.path),
            run.cfg.model.name,
            run.cfg.env.name,
            run.cfg.algo.name,
            f"{len(run.rows)} of {run.cfg.train.steps}",
        ]
        for run in runs
    ]


# ============================================================================ the page


def compare_runs(paths: list[Path], out: Path, say: Callable[[str], None] | None = None) -> Path:
    """Write OUT/compare.md, OUT/compare.html and OUT/plots/*.png; return compare.md's
    path. Every run is read and checked first: a refusal writes nothing. `say` gets the
    short summary of what still fails, a line at a time, once the page is written."""
    if len(paths) < 2:
        raise ConfigError("compare needs at least two run folders")
    runs = [load_run(path) for path in paths]
    name_runs(runs)
    notes = check_same_episodes(runs)
    first, baseline = runs[0], runs[0].evals["baseline"]
    blocks: list[tuple] = [
        ("h1", f"looprl compare: {' · '.join(run.name for run in runs)}"),
        ("table", ["run", "folder", "model", "env", "algo", "steps logged"], header_rows(runs)),
        ("h2", "Config differences"),
    ]
    differences = config_rows(runs)
    if differences:
        blocks.append(("table", ["config key", *(run.name for run in runs)], differences))
    else:
        blocks.append(("p", "The runs' config.yaml files hold the same values."))
    blocks += [
        ("h2", f"Held-out evals, paired against {first.name}"),
        (
            "p",
            f"Every run played the same {_episodes(baseline)} held-out episodes (env "
            f"{baseline.get('env')}, task seed {baseline.get('task_seed')}, eval "
            f"temperature {baseline.get('temperature')}). Each run's mean reward with its "
            f"95% CI, and its paired difference to {first.name} over the same episodes "
            "with a bootstrap 95% CI that resamples whole tasks; better / same / worse "
            f"counts the episodes whose reward is above, equal to or below {first.name}'s.",
        ),
        *[("p", note) for note in notes],
        (
            "table",
            [
                "eval",
                "run",
                "episodes",
                "reward mean [95% CI]",
                f"− {first.name} [95% CI]",
                "better / same / worse",
            ],
            paired_rows(runs),
        ),
        ("h2", "Outcomes (final eval)"),
        (
            "p",
            f"The share of the final eval's episodes ending in each outcome, and the "
            f"difference to {first.name}'s share in percentage points (pp).",
        ),
        ("table", ["outcome", *(run.name for run in runs)], outcome_rows(runs)),
    ]
    failures, lines = compare_failures(runs)
    blocks += failures + plot_blocks(runs, out / "plots")
    out.mkdir(parents=True, exist_ok=True)
    md_path = out / "compare.md"
    md_path.write_text(render_markdown(blocks), encoding="utf-8")
    (out / "compare.html").write_text(render_html(blocks, title=blocks[0][1]), encoding="utf-8")
    for line in lines if say is not None else []:
        say(line)
    return md_path
