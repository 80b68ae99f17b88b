"""What still fails: the per-field table on hand-built episodes (paired numbers by hand),
the episodes still wrong and those that got worse, the answers shown, the section in the
report and in `looprl compare` (page and terminal), and a real tiny run on a data task
whose report names its failing field, opened in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from test_report import chromium, make_run, open_in_chromium, write  # noqa: F401
from typer.testing import CliRunner

from looprl.cli import app
from looprl.config import load_config, to_yaml
from looprl.report.failures import (
    eval_records,
    expected_text,
    field_rows,
    given_text,
    got_worse,
    pair_episodes,
    still_wrong,
    verdicts,
)
from looprl.report.failures_page import pair_blocks
from looprl.report.plots import render_markdown
from looprl.report.stats import paired_difference

CALL = "order"


def record(task, reward, outcome, fields=None, item=None, qty=3, info=None) -> dict:
    """One episode as samples/*.jsonl keeps it: a call to `order` with `item` (none: a
    reply that did not parse), the row's expected call in `task.answer`."""
    reply = {"role": "assistant", "content": ""}
    if item is None:
        reply["parse_failure"] = "bad_json"
    else:
        args = {"item": item, "qty": qty}
        reply["tool_calls"] = [{"type": "function", "function": {"name": CALL, "arguments": args}}]
    answer = {"name": CALL, "arguments": {"item": f"item of {task}", "qty": 3}}
    info = dict(info or {})
    if fields is not None:
        info["fields"] = fields
    return {
        "task_id": task, "task": {"answer": answer}, "reward": reward, "outcome": outcome,
        "messages": [{"role": "user", "content": f"order for {task}"}, reply],
        **({"info": info} if info else {}),
    }  # fmt: skip


def both(item: bool, qty: bool) -> dict:
    return {"item": item, "qty": qty}


# 3 tasks × 2 episodes; e5 is an env_error before training, so it is left out
BEFORE = [
    record("t0", 0.5, "partial", both(False, True), item="pears"),  # e0
    record("t0", 0.5, "partial", both(False, True), item="pears"),  # e1
    record("t1", 1.0, "correct", both(True, True), item="item of t1"),  # e2
    record("t1", 0.0, "wrong", both(False, False), item="figs", qty=9),  # e3
    record("t2", -1.0, "bad_json"),  # e4: no verdicts (the reply did not parse)
    record("t2", 0.0, "env_error"),  # e5
]
AFTER = [
    record("t0", 1.0, "correct", both(True, True), item="item of t0"),  # e0: item fixed
    record("t0", 0.5, "partial", both(False, True), item="plums"),  # e1
    record("t1", 0.25, "partial", both(True, False), item="item of t1", qty=7),  # e2: qty broke
    record("t1", 1.0, "correct", both(True, True), item="item of t1"),  # e3: both fixed
    record("t2", 0.5, "partial", both(False, True), item="limes"),  # e4: qty fixed
    record("t2", 0.5, "partial", both(False, True), item="limes"),  # e5
]


def test_verdicts_are_read_from_each_envs_info():
    assert verdicts({"info": {"fields": {"a": True, "b": False}}}) == {"a": 1.0, "b": 0.0}
    assert verdicts({"info": {"correct": {"date": True}, "truth": {}}}) == {"date": 1.0}
    assert verdicts({"info": {"scores": {"tool_call": 0.5}}}) == {}  # one scorer: the reward
    assert verdicts({"info": {"scores": {"exact": 1.0, "judge": 0.25}}}) == {
        "scorer exact": 1.0, "scorer judge": 0.25}  # fmt: skip
    checks = [{"kind": "words", "passed": True}, {"kind": "words", "passed": False},
              {"kind": "case", "passed": True}]  # fmt: skip
    assert verdicts({"info": {"checks": checks}}) == {"check words": 0.5, "check case": 1.0}
    assert verdicts({"info": {"board": [0] * 9, "best_moves": [3]}}) == {}  # tictactoe-move
    assert verdicts({}) == {}


def test_the_per_field_table_pairs_the_same_episodes():
    pairs = pair_episodes(BEFORE, AFTER)
    assert [p.index for p in pairs] == [0, 1, 2, 3, 4]  # the env_error episode left out
    rows = {r.name: r for r in field_rows(pairs)}
    assert [r.name for r in field_rows(pairs)] == ["item", "qty"]  # the lowest share first
    # item, episode by episode (before, after): (0,1) (0,0) (1,1) (0,1) (0 unread, 0)
    item = rows["item"]
    assert (item.episodes, item.before, item.after) == (5, 1 / 5, 3 / 5)
    assert item.mean == pytest.approx(2 / 5) and (item.fixed, item.broken) == (2, 0)
    # qty: (1,1) (1,1) (1,0) (0,1) (0 unread, 1)
    qty = rows["qty"]
    assert (qty.before, qty.after, qty.fixed, qty.broken) == (3 / 5, 4 / 5, 2, 1)
    assert qty.mean == pytest.approx(1 / 5)
    ids = ["t0", "t0", "t1", "t1", "t2"]
    assert (item.mean, item.lo, item.hi) == paired_difference(
        [0, 0, 1, 0, 0], [1, 0, 1, 1, 0], ids
    )  # the bootstrap over tasks, on the vectors written out by hand
    assert (qty.lo, qty.hi) == paired_difference([1, 1, 1, 0, 0], [1, 1, 0, 1, 1], ids)[1:]
    assert item.lo <= item.mean <= item.hi


def test_every_episode_fixed_gives_a_ci_of_one_point():
    before = [record(f"t{i}", 0.0, "wrong", both(False, True), item="x") for i in range(4)]
    after = [record(f"t{i}", 1.0, "correct", both(True, True), item="y") for i in range(4)]
    (item, qty) = field_rows(pair_episodes(before, after))
    assert (item.name, item.mean, item.lo, item.hi, item.fixed) == ("item", 1.0, 1.0, 1.0, 4)
    assert (qty.mean, qty.lo, qty.hi) == (0.0, 0.0, 0.0)


def test_still_wrong_worst_first_and_what_got_worse():
    pairs = pair_episodes(BEFORE, AFTER)
    wrong = still_wrong(pairs, ["correct"])
    assert [(p.index, n_wrong, n) for p, n_wrong, n in wrong] == [(2, 1, 2), (1, 1, 2), (4, 1, 1)]
    (worst, fell), *rest = got_worse(pairs)
    assert (worst.index, fell, rest) == (2, 1, [])
    md = render_markdown(pair_blocks(pairs, ["correct"]))
    assert "| item | 5 | 20.0% | 60.0% | +40.0 pp [" in md
    assert "After training 3 of 5 episodes are not solved (solved: correct); the fields they " \
        "got wrong: item 2, qty 1." in md  # fmt: skip
    expected = 'order({"item": "item of t1", "qty": 3})'
    assert (
        f'| t1: 1 / 2 | +1.000 → +0.250 | partial | qty | {expected} | '
        'order({"item": "item of t1", "qty": 7}) |'
    ) in md  # fmt: skip
    assert "Got worse: 1 of 5 episodes have a lower reward after than before, on 1 task" in md
    assert (
        f"| t1: 1 / 2 | +1.000 → +0.250 | correct → partial | qty | {expected} | "
        'order({"item": "item of t1", "qty": 3}) | order({"item": "item of t1", "qty": 7}) |'
    ) in md  # fmt: skip


def test_an_env_without_verdicts_gets_no_table_but_its_lists():
    before = [make_record("m1", -1.0, "illegal"), make_record("m2", 0.8, "optimal")]
    after = [make_record("m1", 0.0, "legal"), make_record("m2", -1.0, "illegal")]
    md = render_markdown(pair_blocks(pair_episodes(before, after), ["win", "optimal"]))
    assert "| field |" not in md and "fields" not in md
    assert "After training 2 of 2 episodes are not solved (solved: win, optimal)." in md
    assert "| m2: 1 / 1 | +0.800 → -1.000 | optimal → illegal | [3, 5] | " in md
    md = render_markdown(pair_blocks(pair_episodes(before, after), []))
    assert "no episode is called wrong" in md and "Got worse: 1 of 2 episodes" in md


def make_record(task: str, reward: float, outcome: str) -> dict:
    """A tictactoe-move episode: no verdicts, the best moves as the expected answer."""
    call = {"function": {"name": "choose_square", "arguments": {"square": 7}}}
    return {"task_id": task, "reward": reward, "outcome": outcome,
            "info": {"board": [0] * 9, "best_moves": [3, 5]},
            "messages": [{"role": "assistant", "content": "", "tool_calls": [call]}]}  # fmt: skip


def test_answers_as_shown():
    assert expected_text(BEFORE[0]) == 'order({"item": "item of t0", "qty": 3})'
    assert given_text(BEFORE[4]) == "[bad_json]"
    assert expected_text({"info": {"truth": {"date": "2026-01-02"}}}) == '{"date": "2026-01-02"}'
    assert expected_text({"info": {"expected": "Paris"}, "task": {"answer": "x"}}) == "Paris"
    assert expected_text({"task": {}}) == "-"
    text = {"messages": [{"role": "assistant", "content": "  It is\nParis. " + "x" * 300}]}
    shown = given_text(text)
    assert shown.startswith("It is Paris. xx") and shown.endswith("…") and len(shown) == 120
    assert given_text({"messages": []}) == "(no reply)"


def test_eval_records_are_the_evals_episodes_in_order():
    result = {"task_ids": ["t0", "t1"]}
    one, two = record("t0", 0, "wrong"), record("t1", 0, "wrong")
    assert eval_records([one, two], result) == [one, two]
    assert eval_records([two, one, two], result) == [one, two]  # the later eval, last
    assert "not hold the eval's episodes" in eval_records([two, one], result)
    assert "no transcripts" in eval_records(None, result)
    assert "older looprl" in eval_records([one], {})


# ============================================================================ report, compare


def test_transcripts_that_are_not_the_evals_episodes_are_not_shown(tmp_path):
    md, _ = write(make_run(tmp_path, [], samples=True))  # 4 samples of an 8-episode eval
    section = md.split("## What still fails")[1].split("## Training curves")[0]
    assert section.strip() == (
        "Not shown: the transcripts do not hold the eval's episodes in its order "
        "(samples/baseline.jsonl and samples/final.jsonl)."
    )


def fake_run(root: Path, name: str, final: list[dict], greedy: bool = False) -> Path:
    """A run folder of the dataset env whose baseline is BEFORE and whose final is `final`."""
    run = root / name
    (run / "eval").mkdir(parents=True)
    (run / "samples").mkdir()
    (run / "config.yaml").write_text(to_yaml(load_config(None, ["model.name=tiny-random"])))
    names = [("baseline", BEFORE), ("final", final)]
    if greedy:
        names += [("baseline_greedy", BEFORE[:2]), ("final_greedy", final[:2])]
    for key, records in names:
        rewards = [r["reward"] for r in records]
        result = {"env": "dataset", "model": "tiny-random", "n": len(records),
                  "reward_mean": sum(rewards) / len(rewards), "reward_ci95": [0.0, 0.5],
                  "outcomes": shares(records), "task_seed": 1, "temperature": 1.0,
                  "rewards": rewards,
                  "task_ids": [r["task_id"] for r in records],
                  "episode_outcomes": [r["outcome"] for r in records],
                  "solved_outcomes": ["correct"]}  # fmt: skip
        (run / "eval" / f"{key}.json").write_text(json.dumps(result))
        lines = "".join(json.dumps(r) + "\n" for r in records)
        (run / "samples" / f"{key}.jsonl").write_text(lines)
    return run


def shares(records: list[dict]) -> dict[str, float]:
    labels = [r["outcome"] for r in records]
    return {label: labels.count(label) / len(labels) for label in set(labels)}


def test_the_report_section_with_its_greedy_part(tmp_path):
    md, page = write(fake_run(tmp_path, "run", AFTER, greedy=True))
    section = md.split("## What still fails")[1].split("## Training curves")[0]
    assert "| item | 5 | 20.0% | 60.0% |" in section and "### Greedy (T = 0)" in section
    assert "| item | 2 | 0.0% | 50.0% | +50.0 pp [" in section  # greedy: e0 fixed, e1 not
    assert "Got worse: 1 of 5 episodes" in section and "What still fails</h2>" in page
    (tmp_path / "run" / "samples" / "final_greedy.jsonl").unlink()
    md, _ = write(tmp_path / "run")
    assert "Not shown: no transcripts (samples file missing or empty) (samples/" in md


def test_compare_pairs_each_runs_fields_against_the_first(tmp_path):
    # b fixes e1's item and e4's item, and breaks e3's qty
    b_final = [dict(r) for r in AFTER]
    b_final[1] = record("t0", 1.0, "correct", both(True, True), item="item of t0")
    b_final[3] = record("t1", 0.5, "partial", both(True, False), item="item of t1", qty=1)
    b_final[4] = record("t2", 1.0, "correct", both(True, True), item="item of t2")
    a, b = fake_run(tmp_path, "a", AFTER), fake_run(tmp_path, "b", b_final)
    out = tmp_path / "cmp"
    result = CliRunner().invoke(app, ["compare", str(a), str(b), "--out", str(out)])
    assert result.exit_code == 0, result.output
    md = (out / "compare.md").read_text()
    section = md.split("## What still fails (final eval)")[1].split("## Training curves")[0]
    # item: a (1,0,1,1,0) → b (1,1,1,1,1): +2 of 5 = +40 pp; qty: (1,1,0,1,1) → (1,1,0,0,1)
    assert "| item | 20.0% | 60.0% | +40.0 pp [" in section and "| 100.0% | +40.0 pp [" in section
    assert "| qty | 60.0% | 80.0% | +20.0 pp [" in section and "| 60.0% | -20.0 pp [" in section
    # e2 (t1) is wrong in both runs' finals: the only episode no run solved
    assert "Not solved in any run's final eval: 1 of 5 episodes; the fields a got wrong on " \
        "them: qty 1." in section  # fmt: skip
    assert (
        "b did worse than a on 1 of 5 episodes" in section
        and "| t1: 1 | +1.000 → +0.500 |" in section
    )
    said = " ".join(result.output.split())
    assert "item: before 20.0% · a 60.0% · b 100.0% (b − a +40.0 pp [" in said
    assert "not solved in any run's final eval: 1 of 5 episodes" in said
    assert "b: lower reward than a on 1 of 5 episodes" in said


# ============================================================================ a real run

ITEMS = ["apples", "pears", "plums", "figs", "limes", "dates", "kiwis", "nuts"]
# `qty` and `unit` each allow one value, so the forced call always gets them right; `item`
# is drawn from eight, so the tiny random model gets it wrong: the failing field
ORDER_TOOL = {"type": "function", "function": {"name": CALL, "parameters": {
    "type": "object", "additionalProperties": False, "required": ["item", "qty", "unit"],
    "properties": {"item": {"type": "string", "enum": ITEMS},
                   "qty": {"type": "integer", "enum": [3]},
                   "unit": {"type": "string", "enum": ["kg"]}}}}}  # fmt: skip


@pytest.fixture(scope="module")
def order_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("orders")
    rows = [{"prompt": f"Order 3 kg of {item}", "answer": {"item": item, "qty": 3, "unit": "kg"}}
            for item in ITEMS]  # fmt: skip
    (root / "orders.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = {"path": str(root / "orders.jsonl"), "eval_fraction": 0.25, "tools": [ORDER_TOOL]}
    config = {"env": {"name": "dataset", "args": args}, "rollout": {"max_new_tokens": 64}}
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    args = ["--set", "model.name=tiny-random", "--set", "train.steps=1",
            "--set", "rollout.tasks_per_step=2", "--set", "rollout.group_size=2",
            "--set", "eval.tasks=2", "--set", "eval.samples_per_task=2",
            "--set", "logging.trackers=[]"]  # fmt: skip
    result = CliRunner().invoke(
        app, ["run", str(root / "run.yaml"), *args, "--out", str(root / "run")]
    )
    assert result.exit_code == 0, result.output
    return root / "run"


def table_row(md: str, first: str) -> list[str]:
    rows = [line for line in md.splitlines() if line.startswith(f"| {first} |")]
    assert rows, (first, md)
    return [cell.strip() for cell in rows[0].strip("|").split(" | ")]


@pytest.mark.slow  # one tiny training run on a data file
def test_a_real_runs_report_names_the_failing_field(order_run, tmp_path):
    md = (order_run / "report.md").read_text("utf-8")
    section = md.split("## What still fails")[1].split("### Greedy")[0]
    assert table_row(section, "qty")[3] == table_row(section, "unit")[3] == "100.0%"
    assert table_row(section, "item")[3] != "100.0%"
    first_row = [line for line in section.splitlines() if line.startswith("| ")][2]
    assert first_row.startswith("| item |")  # the lowest share after training comes first
    assert re.search(r"the fields they got wrong: item \d+\.", section)
    assert 'order({"item": "' in section and '"qty": 3, "unit": "kg"})' in section
    # compare against a copy of itself: the same table, no episode worse
    twin = tmp_path / "twin"
    shutil.copytree(order_run, twin)
    out = tmp_path / "cmp"
    result = CliRunner().invoke(app, ["compare", str(order_run), str(twin), "--out", str(out)])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "qty: before 100.0% · run 100.0% · twin 100.0% (twin − run +0.0 pp [+0.0, +0.0])" in said
    assert "twin: lower reward than run on 0 of 4 episodes" in said


@pytest.mark.slow
def test_the_real_report_in_chromium(chromium, order_run, tmp_path):  # noqa: F811
    page = (order_run / "report.html").read_text("utf-8")
    title, console = open_in_chromium(chromium, page, tmp_path)
    assert title.startswith("PROBE images=3/3 ") and console == [], (title, console)
    assert "<h2>What still fails</h2>" in page and "<td>item</td>" in page
