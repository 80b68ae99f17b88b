"""The before/after report: paired bootstrap CI, report.md/report.html on synthetic run
folders (edge cases) and on a real tiny run, and the HTML opened in headless Chromium."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from looprl.config import load_config, to_yaml
from looprl.report import read_metrics
from looprl.report.headline import headline
from looprl.report.stats import paired_difference, paired_stats
from looprl.report.write import regenerate_report, write_report

DATA_URI = '<img src="data:image/png;base64,'
HOSTILE = "<script>document.title='PWNED'</script> ``` </pre> & |"

# ============================================================================ statistics


def test_all_improved_by_one_gives_ci_one_one():
    ids = [f"t{i // 4}" for i in range(16)]
    assert paired_difference([0.0] * 16, [1.0] * 16, ids) == (1.0, 1.0, 1.0)


def test_no_change_gives_a_ci_containing_zero():
    before = [1.0, -1.0, 0.8, 0.0] * 4
    ids = [f"t{i // 4}" for i in range(16)]
    mean, lo, hi = paired_difference(before, before, ids)
    assert mean == 0 and lo <= 0 <= hi
    # changes that cancel out across tasks: a wide interval that still straddles zero
    after = [b + (1 if i < 8 else -1) for i, b in enumerate(before)]
    mean, lo, hi = paired_difference(before, after, ids)
    assert mean == 0 and lo < 0 < hi


def test_bootstrap_resamples_whole_tasks_weighted_by_episodes():
    # task a: 3 episodes +1, task b: 1 episode 0. Resamples are {a,a} → 1, {a,b} → 3/4
    # (all episodes of the drawn tasks), {b,b} → 0; each pair of draws is p = 1/4, 1/2, 1/4.
    mean, lo, hi = paired_difference([0.0] * 4, [1.0, 1.0, 1.0, 0.0], ["a", "a", "a", "b"])
    assert mean == 0.75 and (lo, hi) == (0.0, 1.0)
    # episodes of one task move together: resampling tasks must give a wider CI than
    # pretending each episode is its own task
    before = [0.0] * 40
    after = [1.0 if i < 20 else 0.0 for i in range(40)]
    grouped = paired_difference(before, after, [f"t{i // 10}" for i in range(40)])
    single = paired_difference(before, after, [f"t{i}" for i in range(40)])
    assert grouped[2] - grouped[1] > single[2] - single[1]


def test_bootstrap_is_deterministic_and_skips_non_finite_pairs():
    before = [0.0, 0.5, math.nan, 1.0, 0.0, 0.2]
    after = [1.0, 0.5, 1.0, 0.0, 0.8, 0.2]
    ids = ["a", "a", "b", "b", "c", "c"]
    first = paired_difference(before, after, ids)
    assert first == paired_difference(before, after, ids)
    assert first[0] == pytest.approx((1.0 + 0.0 - 1.0 + 0.8 + 0.0) / 5)
    assert paired_difference([math.nan], [1.0], ["a"]) is None


def test_paired_stats_refuses_unmatched_episodes():
    base = {"rewards": [0.0, 1.0], "task_ids": ["a", "b"]}
    assert "same episodes" in paired_stats(base, {"rewards": [1.0], "task_ids": ["a"]})
    assert "same episodes" in paired_stats(base, {"rewards": [1.0, 1.0], "task_ids": ["b", "a"]})
    assert "older" in paired_stats({"reward_mean": 0.0}, base)
    stats = paired_stats(base, {"rewards": [1.0, 0.0], "task_ids": ["a", "b"]})
    assert (stats.better, stats.same, stats.worse, stats.tasks) == (1, 0, 1, 2)


# ============================================================================ synthetic runs


def eval_result(rewards: list[float], outcomes: dict[str, float]) -> dict:
    n = len(rewards)
    mean = sum(rewards) / n
    return {
        "env": "tictactoe-move", "model": "tiny-random", "n": n, "reward_mean": mean,
        "reward_ci95": [mean - 0.1, mean + 0.1], "valid_tool_call_rate": 1.0,
        "response_len": 30.0, "outcomes": outcomes, "task_seed": 1234,
        "rewards": rewards, "task_ids": [f"move-{i // 2}" for i in range(n)],
    }  # fmt: skip


def sample(task_id: str, reward: float, outcome: str, text: str = "", square: int = 5) -> dict:
    return {
        "step": None, "task_id": task_id, "task": {}, "reward": reward, "outcome": outcome,
        "response_len": 30,
        "messages": [
            {"role": "system", "content": "You play tic-tac-toe."},
            {"role": "user", "content": f"Board of {task_id}"},
            {"role": "assistant", "content": text, "tool_calls": [{"type": "function",
             "function": {"name": "choose_square", "arguments": {"square": square}}}]},
        ],
        "completions": [text],
    }  # fmt: skip


def make_run(
    root: Path,
    metrics: list[dict] | None = None,
    final: bool = True,
    samples: bool = True,
) -> Path:
    """A run folder as `looprl run` leaves it: 4 tasks × 2 episodes; the 'after' side
    never plays an illegal move and a model text is hostile HTML."""
    run = root / "run"
    (run / "eval").mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(load_config(None, ["model.name=tiny-random"])))
    baseline = eval_result([-1.0, 0.0, 0.8, -1.0, 1.0, 0.0, 0.0, 0.8], {"illegal": 0.25,
                           "legal": 0.375, "optimal": 0.25, "win": 0.125})  # fmt: skip
    (run / "eval" / "baseline.json").write_text(json.dumps(baseline))
    if final:
        after = eval_result([0.8, 0.0, 0.8, 1.0, 1.0, 0.8, 0.0, 0.8],
                            {"legal": 0.25, "optimal": 0.5, "win": 0.25})  # fmt: skip
        (run / "eval" / "final.json").write_text(json.dumps(after))
    if metrics is not None:
        (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if samples:
        (run / "samples").mkdir()
        before = [sample(f"move-{i}", -1.0, "illegal", HOSTILE) for i in range(4)]
        after = [sample(f"move-{i}", 0.8, "optimal", square=1) for i in range(4)]
        for name, records in (("baseline", before), ("final", after)):
            lines = "".join(json.dumps(r) + "\n" for r in records)
            (run / "samples" / f"{name}.jsonl").write_text(lines)
    return run


def step(i: int, reward: float | None = 0.1, rss: float = 1.5) -> dict:
    return {"step": i, "rollout/rewards_mean": reward, "response_len": 30.0 + i,
            "perf/step_s": 2.0, "perf/peak_rss_gb": rss}  # fmt: skip


def write(run: Path, final: bool = True) -> tuple[str, str]:
    cfg = load_config(run / "config.yaml")
    base = json.loads((run / "eval" / "baseline.json").read_text())
    after = json.loads((run / "eval" / "final.json").read_text()) if final else None
    md = write_report(run, cfg, base, after, 123.0, 2.5)
    return md.read_text("utf-8"), (run / "report.html").read_text("utf-8")


def test_report_tables_plots_and_escaping(tmp_path):
    run = make_run(tmp_path, [step(1), step(2, None), step(3, math.nan), step(4, 0.4)])
    md, page = write(run)
    assert "| metric | before | after |" in md
    assert "| reward mean [95% CI] | +0.075 [-0.025, +0.175] | +0.650 [+0.550, +0.750] |" in md
    assert "| outcome: illegal | 25.0% | 0.0% |" in md  # a label seen on one side only
    assert "Paired difference (after − before, episode by episode): +0.575" in md
    assert "4 steps logged of" in md and "wall-clock 2.0 min" in md
    plots = sorted(p.name for p in (run / "plots").glob("*.png"))
    assert plots == ["before_after.png", "outcomes.png", "training_curves.png"]
    for name in plots:
        assert f"](plots/{name})" in md
    assert page.count(DATA_URI) == len(plots)
    assert 'src="http' not in page and "href=" not in page  # nothing fetched
    # model text is escaped in HTML and cannot close its Markdown fence
    assert "<script>document" not in page and "&lt;script&gt;document.title=" in page
    assert "&lt;/pre&gt;" in page
    assert "\n````\n" in md and HOSTILE in md


def test_report_without_metrics_or_samples(tmp_path):
    md, page = write(make_run(tmp_path, metrics=None, samples=False))
    assert "No training step was logged" in md and "0 logged of" in md
    assert "Skipped: samples/baseline.jsonl or samples/final.jsonl is missing." in md
    assert not (tmp_path / "run" / "plots" / "training_curves.png").exists()
    assert page.count(DATA_URI) == 2


def test_report_without_per_episode_rewards(tmp_path):
    run = make_run(tmp_path, [step(1)])
    for name in ("baseline", "final"):
        path = run / "eval" / f"{name}.json"
        result = json.loads(path.read_text())
        del result["rewards"], result["task_ids"]
        path.write_text(json.dumps(result))
    md, page = write(run)
    assert "Paired difference not computed" in md and page.count(DATA_URI) == 3


def test_partial_report_of_a_stopped_run(tmp_path):
    md, page = write(make_run(tmp_path, [step(1), step(2)], final=False), final=False)
    assert "Stopped after step 2 of" in md and "--resume" in md
    assert "| metric | before |" in md and "Transcripts" not in md
    assert page.count(DATA_URI) == 2  # outcomes (before only) and training curves


def test_regenerate_takes_time_and_memory_from_metrics(tmp_path):
    run = make_run(tmp_path, [step(1, rss=1.5), step(2, rss=3.25), step(3, rss=2.0)])
    md = regenerate_report(run).read_text("utf-8")
    assert "training time (sum of perf/step_s) 6 s" in md and "peak RSS 3.25 GB" in md
    (run / "eval" / "final.json").unlink()
    assert "Stopped after step 3" in regenerate_report(run).read_text("utf-8")
    assert not (run / "plots" / "before_after.png").exists()  # no stale plot left behind


def test_read_metrics_skips_a_line_torn_by_a_killed_run(tmp_path):
    assert read_metrics(tmp_path) == []  # no metrics.jsonl: no step
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2]


def looprl(*args: str | Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "looprl.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_report_command_refuses_a_folder_that_is_not_a_run(tmp_path):
    res = looprl("report", tmp_path)
    assert res.returncode == 2 and "is not a run folder" in res.stderr
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    res = looprl("report", tmp_path)
    assert res.returncode == 2 and "no eval/baseline.json" in res.stderr


# ============================================================================ a real run


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("report") / "run"
    res = looprl(
        "run", "--set", "model.name=tiny-random", "--set", "train.steps=3",
        "--set", "rollout.tasks_per_step=2", "--set", "rollout.group_size=4",
        "--set", "eval.tasks=4", "--out", run, "--force",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return run


def test_real_run_report_and_regeneration(tiny_run):
    md = (tiny_run / "report.md").read_text("utf-8")
    assert "| metric | before | after |" in md and "3 steps logged of 3 configured" in md
    assert "### Task move-" in md
    # tictactoe-move's episodes carry no field verdicts: what still fails, without a table
    section = md.split("## What still fails")[1].split("## Training curves")[0]
    assert "| field |" not in section and "(solved: win, optimal)" in section
    page = (tiny_run / "report.html").read_text("utf-8")
    assert page.count(DATA_URI) == 3 == len(list((tiny_run / "plots").glob("*.png")))
    (tiny_run / "report.html").unlink()
    shutil.rmtree(tiny_run / "plots")
    res = looprl("report", tiny_run)
    assert res.returncode == 0, res.stderr
    assert (tiny_run / "report.html").read_text("utf-8").count(DATA_URI) == 3
    assert "training time (sum of perf/step_s)" in (tiny_run / "report.md").read_text("utf-8")


# ============================================================================ in a browser

# Injected into a copy only: the report's own CSP forbids scripts. After `load` it puts
# the result into the title, which --dump-dom prints.
PROBE = """<script>
window.addEventListener("load", () => {
  const images = Array.from(document.images);
  const loaded = images.filter((img) => img.complete && img.naturalWidth > 0).length;
  const shown = document.body.innerText.includes("<script>document.title");
  document.title = `PROBE images=${loaded}/${images.length} hostile_text_shown=${shown}`;
});
</script>"""
# What chromium's --enable-logging=stderr prints for every console message of a page
# (errors, uncaught exceptions, CSP violations), e.g.
# [1:1:1129/210426.9:INFO:CONSOLE:76] "Uncaught Error: boom", source: file:///x.html (76)
CONSOLE_LINE = re.compile(r":CONSOLE[(:]\d*\)?\] (.*)")


@pytest.fixture(scope="module")
def chromium() -> str:
    # module scope and listed first: without a browser, skip before the tiny run is made
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    return path


def open_in_chromium(chromium: str, html_text: str, tmp: Path) -> tuple[str, list[str]]:
    """Load a copy of the page with PROBE in headless Chromium; return the probe's title
    and the page's console messages."""
    csp = "default-src 'none';"
    assert csp in html_text
    page = tmp / "probe.html"
    page.write_text(
        html_text.replace(csp, csp + " script-src 'unsafe-inline';", 1).replace(
            "</body>", PROBE + "</body>"
        )
    )
    cmd = [
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={tmp / 'profile'}", "--enable-logging=stderr",
        "--v=0", "--dump-dom", page.as_uri(),
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    title = re.search(r"<title>(PROBE[^<]*)</title>", res.stdout)
    assert title, f"chromium rc={res.returncode}, no probe result:\n{res.stderr[-3000:]}"
    return title.group(1), CONSOLE_LINE.findall(res.stderr)


@pytest.mark.parametrize("source", ["real tiny run", "synthetic hostile text"])
def test_report_renders_in_chromium(chromium, source, tiny_run, tmp_path):
    run = tiny_run if source == "real tiny run" else make_run(tmp_path, [step(1), step(2)])
    if source != "real tiny run":
        write(run)
    title, console = open_in_chromium(chromium, (run / "report.html").read_text("utf-8"), tmp_path)
    assert title.startswith("PROBE images=3/3 "), title
    assert console == [], console
    if source != "real tiny run":
        assert title.endswith("hostile_text_shown=true"), title  # shown as text, not run


def test_chromium_check_sees_broken_images_and_errors(chromium, tmp_path):
    # the detector itself: a broken image and an uncaught error must not pass unnoticed
    page = (
        "<!doctype html><html><head><meta http-equiv='Content-Security-Policy' "
        "content=\"default-src 'none'; img-src data:\"><title>x</title></head><body>"
        '<img src="data:image/png;base64,AAAA"><script>throw new Error("boom")</script>'
        "</body></html>"
    )
    title, console = open_in_chromium(chromium, page, tmp_path)
    assert title.startswith("PROBE images=0/1"), title
    assert any("Uncaught Error: boom" in line for line in console), console


# ============================================================================ levers shown


def paired_result(outcomes: list[str], rewards: list[float], solved: list[str]) -> dict:
    shares = {k: outcomes.count(k) / len(outcomes) for k in sorted(set(outcomes))}
    result = eval_result(rewards, shares)
    result.update(episode_outcomes=outcomes, solved_outcomes=solved)
    return result


def test_reward_rise_without_more_solved_episodes_is_flagged_at_the_top(tmp_path):
    # 8 tasks × 2 episodes: the illegal moves became legal non-optimal ones (reward -1 -> 0),
    # the optimal ones stayed: the reward rose, the solved share (win, optimal) did not
    run = make_run(tmp_path, [step(1)])
    solved = ["win", "optimal"]
    before = paired_result(["illegal", "optimal"] * 4, [-1.0, 0.8] * 4, solved)
    after = paired_result(["legal", "optimal"] * 4, [0.0, 0.8] * 4, solved)
    (run / "eval" / "baseline.json").write_text(json.dumps(before))
    (run / "eval" / "final.json").write_text(json.dumps(after))
    md, page = write(run)
    warning = md.split("## Before / after")[0]
    assert "> **Warning:** Check the reward: the held-out reward rose (+0.500" in warning
    assert "share of solved episodes (win, optimal) did not: 50.0% → 50.0%" in warning
    assert "illegal 50% → 0%, legal 0% → 50%" in warning
    assert '<p class="warn"><strong>Warning:</strong> Check the reward' in page
    assert "Solved (win, optimal): 50.0% → 50.0%, paired +0.0 points" in md
    # the same rise with the illegal moves turned into optimal ones: no warning
    better = paired_result(["optimal", "optimal"] * 4, [0.8, 0.8] * 4, solved)
    (run / "eval" / "final.json").write_text(json.dumps(better))
    md, _ = write(run)
    assert "Warning" not in md and "Solved (win, optimal): 50.0% → 100.0%" in md


def test_greedy_section_and_its_own_flag(tmp_path):
    run = make_run(tmp_path, [step(1)])
    solved = ["win", "optimal"]
    before = paired_result(["illegal", "win", "legal", "win"], [-1.0, 1.0, 0.0, 1.0], solved)
    after = paired_result(["legal", "win", "legal", "win"], [0.0, 1.0, 0.0, 1.0], solved)
    before["task_ids"] = after["task_ids"] = ["move-0", "move-1", "move-2", "move-3"]
    (run / "eval" / "baseline_greedy.json").write_text(json.dumps(before))
    (run / "eval" / "final_greedy.json").write_text(json.dumps(after))
    md, _ = write(run)
    greedy = md.split("## Greedy policy (T = 0)")[1].split("##")[0]
    assert "| reward mean [95% CI] |" in greedy and "| outcome: illegal | 25.0% | 0.0% |" in greedy
    assert "Paired difference (after − before, episode by episode): +0.250" in greedy
    # one task in four moved: the task bootstrap's CI reaches 0, so no greedy warning
    assert "greedy (T = 0) reward rose" not in md


def test_outcome_colours_carry_meaning():
    from looprl.report.plots import outcome_colors

    labels = ["bad_json", "draw", "illegal", "legal", "loss", "optimal", "win"]
    colors = dict(zip(labels, outcome_colors(labels, ("win", "optimal"))))
    rgb = {k: tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)) for k, c in colors.items()}
    for good in ("win", "optimal"):
        r, g, b = rgb[good]
        assert g > r + 40 and g > b + 20, (good, colors[good])  # green
    for bad in ("illegal", "loss"):
        r, g, b = rgb[bad]
        assert r > g + 80 and r > b + 60, (bad, colors[bad])  # red
    r, g, b = rgb["bad_json"]
    assert abs(r - g) < 10 and abs(g - b) < 10  # grey
    assert len(set(colors.values())) == len(labels)
    # against perfect play a draw is the success: green
    r, g, b = (int(outcome_colors(["draw"], ("win", "draw"))[0][i : i + 2], 16) for i in (1, 3, 5))
    assert g > r + 40


def test_outcome_chart_colours_in_chromium(chromium, tmp_path):
    """A screenshot of the outcome chart as a browser shows it: red for the illegal share
    before, green for the wins after, and no blue anywhere."""
    from PIL import Image

    from looprl.report.plots import plot_outcomes

    png = plot_outcomes(
        [("before", {"illegal": 1.0}), ("after", {"win": 1.0})], tmp_path / "o.png", ("win",)
    )
    shot = tmp_path / "shot.png"
    cmd = [
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
        "--window-size=1000,400", png.as_uri(),
    ]  # fmt: skip
    subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert shot.is_file(), "chromium wrote no screenshot"
    r, g, b = np.asarray(Image.open(shot).convert("RGB"), dtype=int).reshape(-1, 3).T
    red = int(((r > g + 80) & (r > b + 80)).sum())
    green = int(((g > r + 40) & (g > b + 20)).sum())
    blue = int(((b > r + 60) & (b > g + 30)).sum())
    assert red > 2000 and green > 2000, (red, green)
    assert blue < 50, blue


def test_training_curves_get_a_panel_per_entropy_logged(tmp_path):
    # rollout/entropy and rollout/decision_entropy each add a panel of the same width
    from PIL import Image

    from looprl.report.plots import plot_curves

    rows = [{"step": s, "rollout/rewards_mean": 0.1 * s, "response_len": 20} for s in (1, 2, 3)]
    widths = []
    for extra in (
        {},
        {"rollout/entropy": 0.6},
        {"rollout/entropy": 0.6, "rollout/decision_entropy": 0.2},
    ):
        path = plot_curves([{**r, **extra} for r in rows], tmp_path / f"c{len(extra)}.png")
        widths.append(Image.open(path).size[0])
    assert widths[0] < widths[1] < widths[2]
    assert widths[2] - widths[1] == pytest.approx(widths[1] - widths[0], abs=4)


def test_the_rl_stage_after_sft_is_paired_and_warned_when_it_lowers_the_reward(tmp_path):
    # after SFT every episode scored 1.0; the RL steps took 4 of 8 down to 0.0 or 0.8
    run = make_run(tmp_path, [step(1)])
    mid = eval_result([1.0] * 8, {"win": 1.0})
    (run / "eval" / "after_sft.json").write_text(json.dumps(mid))
    md, _ = write(run)
    final = json.loads((run / "eval" / "final.json").read_text())
    diff = [a - 1.0 for a in final["rewards"]]
    assert f"RL stage alone (after − after SFT, paired): {sum(diff) / 8:+.3f}" in md
    assert ": below the SFT warm start" in md
    assert "The RL steps lowered the held-out reward below the SFT warm start's" in md
    assert "algo.kl_reference=start" in md
    lines = headline(json.loads((run / "eval" / "baseline.json").read_text()), final,
                     run / "report.md", after_sft=mid)  # fmt: skip
    assert any(line.startswith("RL stage alone") and "below the SFT" in line for line in lines)
    # an RL stage that added: no warning
    (run / "eval" / "after_sft.json").write_text(json.dumps(eval_result([0.0] * 8, {"legal": 1.0})))
    md, _ = write(run)
    assert "RL stage alone (after − after SFT, paired): +0.650" in md
    assert "lowered the held-out reward" not in md
    # without a warm start there is no RL-stage line
    (run / "eval" / "after_sft.json").unlink()
    assert "RL stage alone" not in write(run)[0]
