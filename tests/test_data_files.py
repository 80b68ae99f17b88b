"""A user's own data file as a `dataset` env, the way a newcomer meets it: text fields
matched as the scorer says (exact, casefold or normalized), paths found beside the config
file, hub datasets and the offline error, and the smaller gaps (rows dropped or repeated,
a column missing from every row, the eval file's own column names, what `envs show`
prints). Real files, the real CLI, `datasets` for the saved folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from looprl.cli import app
from looprl.envs import make_env
from looprl.envs.data.scorers import make_scorers
from looprl.errors import EnvError

ROOT = Path(__file__).parent.parent
ORDER = {
    "type": "function",
    "function": {
        "name": "order",
        "parameters": {
            "type": "object",
            "properties": {
                "part": {"type": "string"},
                "qty": {"type": "integer"},
                "sku": {"type": "string"},
            },
            "required": ["part", "qty", "sku"],
        },
    },
}
TINY = ["--set", "model.name=tiny-random", "--set", "train.steps=1",
        "--set", "rollout.tasks_per_step=2", "--set", "rollout.group_size=2",
        "--set", "eval.tasks=2", "--set", "eval.samples_per_task=1",
        "--set", "rollout.max_new_tokens=48"]  # fmt: skip


@pytest.fixture()
def runner():
    return CliRunner()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def order_rows(n: int, part: str = "hinge", start: int = 1) -> list[dict]:
    return [{"prompt": f"Order {i} {part}s, SKU AB-{i}, in lower case",
             "answer": {"part": part, "qty": i, "sku": f"AB-{i}"}}
            for i in range(start, start + n)]  # fmt: skip


def orders_config(folder: Path, **args) -> Path:
    """orders_train.jsonl, orders_eval.jsonl and run.yaml in `folder`, the paths relative."""
    write_jsonl(folder / "orders_train.jsonl", order_rows(8))
    write_jsonl(folder / "orders_eval.jsonl", order_rows(4, "bolt", start=20))
    env = {"path": "orders_train.jsonl", "eval_path": "orders_eval.jsonl", "tools": [ORDER],
           **args}  # fmt: skip
    (folder / "run.yaml").write_text(yaml.safe_dump({"env": {"name": "dataset", "args": env}}))
    return folder / "run.yaml"


def call(part: str, qty: int, sku: str) -> dict:
    return {"name": "order", "arguments": {"part": part, "qty": qty, "sku": sku}}


# --------------------------------------------------------------------------- matching


WANT = call("hinge", 3, "AB-3")


@pytest.mark.parametrize(
    ("spec", "got", "fields"),
    [
        # the default folds case, punctuation and spaces: old configs score the same
        ("tool_call", call("Hinge.", 3, "ab 3"), {"part": True, "qty": True, "sku": True}),
        ({"name": "tool_call", "match": "exact"}, call("Hinge", 3, "AB-3"),
         {"part": False, "qty": True, "sku": True}),
        ({"name": "tool_call", "match": "exact"}, call("hinge", 3.0, "AB-3"),
         {"part": True, "qty": True, "sku": True}),  # numbers still compare as numbers
        ({"name": "tool_call", "match": "casefold"}, call("HINGE", 3, "AB 3"),
         {"part": True, "qty": True, "sku": False}),
        ({"name": "tool_call", "field_match": {"sku": "exact"}}, call("Hinge", 3, "ab-3"),
         {"part": True, "qty": True, "sku": False}),
        ({"name": "tool_call", "match": "exact", "field_match": {"part": "casefold"}},
         call("Hinge", 3, "ab-3"), {"part": True, "qty": True, "sku": False}),
    ],
)  # fmt: skip
def test_text_fields_match_as_the_scorer_says(spec, got, fields):
    (scorer,) = make_scorers(spec)
    assert scorer(got, WANT, {}).fields == fields
    (as_json,) = make_scorers({**spec, "name": "json_fields"} if isinstance(spec, dict)
                              else "json_fields")  # fmt: skip
    assert as_json(got["arguments"], WANT["arguments"], {}).fields == fields


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"name": "tool_call", "match": "exct"},
         "scorers (tool_call): match='exct' is not a way to match text; did you mean 'exact'?"),
        ({"name": "json_fields", "field_match": {"sku": "case"}},
         "field_match.sku='case' is not a way to match text; did you mean 'casefold'?"),
        ({"name": "tool_call", "field_match": ["sku"]}, "field_match=['sku']: expected"),
        ({"name": "tool_call", "match": ["exact"]}, "match=['exact'] is not a way to match"),
    ],
)  # fmt: skip
def test_a_misspelt_match_is_an_error_with_a_suggestion(spec, needle):
    with pytest.raises(EnvError) as err:
        make_scorers(spec)
    assert needle in str(err.value)


def test_a_field_match_naming_no_answers_field_is_an_error(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", order_rows(6))
    spec = {"name": "tool_call", "field_match": {"skus": "exact"}}
    with pytest.raises(EnvError) as err:
        make_env("dataset", {"path": str(train), "tools": [ORDER], "scorers": spec,
                             "eval_fraction": 0.5})  # fmt: skip
    want = ("scorers (tool_call): field_match names 'skus', a field no row's answer has; "
            "did you mean 'sku'? the answers' fields: part, qty, sku")  # fmt: skip
    assert want in str(err.value)


def test_a_misspelt_match_exits_2_through_the_cli(runner, tmp_path):
    config = orders_config(tmp_path, scorers={"name": "tool_call", "match": "exct"})
    res = runner.invoke(app, ["envs", "check", "--config", str(config)])
    assert res.exit_code == 2 and "did you mean 'exact'" in res.stderr


def test_envs_show_prints_the_answer_its_tokens_and_the_matching(runner, tmp_path):
    spec = {"name": "tool_call", "match": "casefold", "field_match": {"sku": "exact"}}
    config = orders_config(tmp_path / "task", scorers=spec)
    res = runner.invoke(app, ["envs", "show", "--config", str(config), "--split", "eval"])
    assert res.exit_code == 0, res.output
    shown = res.stdout
    assert '"arguments": {"part": "bolt"' in shown and "expected answer" in shown
    tokens = int(shown.split("demonstration: ")[1].split(" tokens")[0])
    assert 20 < tokens < 80
    assert "text fields casefold (case folded, all else as written); sku: exact" in shown


# ------------------------------------------------------------------------------ paths


def test_paths_are_found_beside_the_config_file(runner, tmp_path, monkeypatch):
    config = orders_config(tmp_path / "task")
    monkeypatch.chdir(tmp_path)  # another folder than the config's
    shown = runner.invoke(app, ["config", "show", str(config)])
    assert shown.exit_code == 0, shown.output
    args = yaml.safe_load(shown.stdout)["env"]["args"]
    assert args["path"] == str((tmp_path / "task" / "orders_train.jsonl").resolve())
    checked = runner.invoke(app, ["envs", "check", "--config", str(config)])
    assert checked.exit_code == 0, checked.output
    planned = runner.invoke(app, ["plan", str(config), "--set", "model.name=tiny-random"])
    assert planned.exit_code == 0, planned.output


def test_a_missing_file_names_every_path_tried_and_the_run_writes_nothing(runner, tmp_path,
                                                                         monkeypatch):  # fmt: skip
    config = orders_config(tmp_path / "task", path="orders_trian.jsonl")
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["run", str(config), *TINY, "--out", str(tmp_path / "run")])
    assert res.exit_code == 2
    tried = f"{tmp_path / 'task' / 'orders_trian.jsonl'} and {tmp_path / 'orders_trian.jsonl'}"
    assert (f"env.args.path: data file orders_trian.jsonl does not exist (looked in {tried})"
            in res.stderr.replace("\n", ""))  # fmt: skip
    assert not (tmp_path / "run").exists()


def test_the_current_folder_still_works_and_the_config_folder_wins_a_tie(tmp_path, monkeypatch):
    from looprl.cli.common import load_run_config

    config = orders_config(tmp_path / "task")
    (tmp_path / "task" / "orders_train.jsonl").rename(tmp_path / "orders_train.jsonl")
    monkeypatch.chdir(tmp_path)
    only_here = load_run_config(config, None).env.args["path"]
    assert only_here == str(tmp_path / "orders_train.jsonl")  # only in the current folder
    write_jsonl(tmp_path / "task" / "orders_train.jsonl", order_rows(8))
    both = load_run_config(config, None).env.args["path"]
    assert both == str(tmp_path / "task" / "orders_train.jsonl")  # both: the config's folder


def test_a_mix_members_files_are_found_too(tmp_path, monkeypatch):
    from looprl.cli.common import load_run_config

    orders_config(tmp_path / "task")
    member = {"name": "dataset", "args": {"path": "orders_train.jsonl", "tools": [ORDER],
                                          "eval_path": "orders_eval.jsonl"}}  # fmt: skip
    config = tmp_path / "task" / "mix.yaml"
    config.write_text(yaml.safe_dump({"env": {"mix": [member, {"name": "tictactoe-move"}]}}))
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(config, None)
    assert cfg.env.mix[0]["args"]["path"] == str(tmp_path / "task" / "orders_train.jsonl")
    assert cfg.env.args == {"members": cfg.env.mix}
    make_env(cfg.env.name, cfg.env.args)


def test_each_env_finds_the_files_it_declares_and_only_those(tmp_path, monkeypatch):
    from looprl.envs import with_found_files

    write_jsonl(tmp_path / "task" / "shop.jsonl", order_rows(2))
    monkeypatch.chdir(tmp_path)
    args = {"server": "python server.py", "tasks": "shop.jsonl", "system_prompt": "shop.jsonl"}
    found = with_found_files("mcp", args, tmp_path / "task")
    assert found == {**args, "tasks": str(tmp_path / "task" / "shop.jsonl")}
    assert with_found_files("tictactoe-move", {"path": "x"}, tmp_path) == {"path": "x"}


def test_a_run_folders_config_loads_from_anywhere(runner, tmp_path, monkeypatch):
    config = orders_config(tmp_path / "task")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    res = runner.invoke(app, ["run", str(config), *TINY, "--out", str(out)])
    assert res.exit_code == 0, res.output
    saved = yaml.safe_load((out / "config.yaml").read_text())["env"]["args"]
    assert Path(saved["path"]).is_absolute() and Path(saved["eval_path"]).is_absolute()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    from looprl.cli.common import load_run_config

    cfg = load_run_config(out / "config.yaml", None)  # as `looprl run --resume` loads it
    assert cfg.env.args == saved
    assert len(make_env(cfg.env.name, cfg.env.args).rows.eval) == 4


# ------------------------------------------------------------------------ hub datasets


def test_a_saved_dataset_dict_with_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "orders"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{**r, "answer": json.dumps(r["answer"])}
                                             for r in order_rows(6)]),
        "test": datasets.Dataset.from_list([{**r, "answer": json.dumps(r["answer"])}
                                            for r in order_rows(3, "bolt", start=20)]),
    }).save_to_disk(str(saved))  # fmt: skip
    env = make_env("dataset", {"path": str(saved), "eval_split": "test", "tools": [ORDER]})
    assert len(env.rows.train) == 6 and len(env.rows.eval) == 3
    assert env.rows.eval[0].data["answer"]["arguments"]["part"] == "bolt"
    with pytest.raises(EnvError, match="without a 'validation' split; its splits: train, test"):
        make_env("dataset", {"path": str(saved), "eval_split": "validation", "tools": [ORDER]})


def test_a_hub_dataset_offline_is_one_error_saying_what_works_offline(tmp_path):
    pytest.importorskip("datasets")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, "-m", "looprl", "envs", "check", "dataset",
         "--arg", "path=acme/orders", "--arg", "revision=v1"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    message = " ".join(res.stderr.split())
    assert "acme/orders is not a local file or folder" in message
    assert "the Hugging Face hub could not give it" in message
    assert "Offline, looprl reads data files (.jsonl, .csv, .parquet)" in message
    assert "save_to_disk" in message and "Traceback" not in res.stderr


# ----------------------------------------------------------------------- smaller gaps


def test_dropped_and_repeated_train_rows_are_said(tmp_path, capsys):
    rows = order_rows(6)
    rows += [rows[0], {**rows[1], "answer": {"part": "hinge", "qty": 99, "sku": "X"}}]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    held = write_jsonl(tmp_path / "eval.jsonl", order_rows(2, start=5) + order_rows(2, "nut"))
    env = make_env("dataset", {"path": str(train), "eval_path": str(held), "tools": [ORDER]})
    assert len(env.rows.train) == 6 and env.rows.dropped == 2  # both copies of 5 and 6
    err = capsys.readouterr().err
    assert "2 train row(s) dropped: their prompt is also a held-out row's" in err
    assert "2 train row(s) repeat an earlier row's prompt (kept" in err
    assert "1 such prompt(s) with different answers" in err


def test_the_eval_file_has_its_own_column_names(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", order_rows(6))
    renamed = [{"q": r["prompt"], "gold": r["answer"]} for r in order_rows(3, "nut")]
    held = write_jsonl(tmp_path / "eval.jsonl", renamed)
    args = {"path": str(train), "eval_path": str(held), "tools": [ORDER]}
    with pytest.raises(EnvError) as err:
        make_env("dataset", args)
    assert "eval.jsonl: a 'prompt' or 'messages' column is missing from every row; the " \
        "file's columns: gold, q (env.args.eval_columns" in str(err.value)  # fmt: skip
    env = make_env("dataset", {**args, "eval_columns": {"prompt": "q", "answer": "gold"}})
    assert [t.data["answer"]["arguments"]["part"] for t in env.rows.eval] == ["nut"] * 3
    with pytest.raises(EnvError, match="eval_columns maps the columns of eval_path's file"):
        make_env("dataset", {"path": str(train), "eval_columns": {"prompt": "q"}})
