"""The command line: help, envs, config show/fields and every kind of bad config."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from looprl.cli import app
from looprl.config import DEFAULT_CLIP, config_from_dict, describe_fields, load_config
from looprl.errors import ConfigError

# wide and plain: rich must neither wrap long lines nor add colour codes
ENV = {"COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}
LOOPRL = Path(sys.executable).with_name("looprl")


@pytest.fixture(scope="module")
def runner():
    return CliRunner(env=ENV)


def invoke(runner, *args: str):
    return runner.invoke(app, list(args))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LOOPRL), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **ENV},
    )


# ------------------------------------------------------------------ help / envs


def test_help_lists_commands():
    res = cli("--help")
    assert res.returncode == 0, res.stderr
    for command in ("run", "eval", "envs", "config"):
        assert re.search(rf"^\W*{command}\b", res.stdout, re.M), command


def test_no_args_shows_help(runner):
    res = invoke(runner)
    assert "Usage" in res.output and "envs" in res.output


def test_envs_lists_builtins_with_descriptions(runner):
    res = invoke(runner, "envs")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    for name, description in [
        ("tictactoe-move", "Pick X's best move in a tic-tac-toe position (one tool call)."),
        ("tictactoe-game", "Play a whole tic-tac-toe game against a scripted opponent."),
    ]:
        assert any(name in line and description in line for line in lines), name


@pytest.mark.parametrize(
    ("name", "board_line"),
    [("tictactoe-move", r" \S \| \S \| \S"), ("tictactoe-game", r" 1 \| 2 \| 3")],
)
def test_envs_show_prints_rendered_prompt(runner, name, board_line):
    res = invoke(runner, "envs", "show", name, "--model", "tiny-random")
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "<|im_start|>system" in out and "<|im_start|>user" in out
    assert out.count("---+---+---") >= 2 and re.search(board_line, out)
    assert '"choose_square"' in out  # in the fallback block and in the schema dump
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if "rendered prompt" in line) + 1
    last = next(i for i, line in enumerate(lines) if "tool schemas" in line)
    prompt_part = "\n".join(lines[first:last])
    assert "<tools>" in prompt_part and "choose_square" in prompt_part
    assert prompt_part.rstrip().endswith("<|im_start|>assistant")
    assert "fallback system block" in out and "call syntax: hermes" in out
    assert "tool_choice=required" in out


def test_envs_show_passes_env_args(runner):
    res = invoke(
        runner, "envs", "show", "tictactoe-move", "--model", "tiny-random",
        "--arg", "tool_choice=auto",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "tool_choice=auto" in res.stdout


def test_envs_show_unknown_env(runner):
    res = invoke(runner, "envs", "show", "nope", "--model", "tiny-random")
    assert res.exit_code == 2
    assert "unknown environment 'nope'" in res.stderr
    assert "tictactoe-move" in res.stderr
    assert "Traceback" not in res.output


def test_envs_show_bad_env_arg(runner):
    res = invoke(runner, "envs", "show", "tictactoe-game", "--arg", "opponent=genius")
    assert res.exit_code == 2
    assert "opponent='genius' is invalid" in res.stderr


# ------------------------------------------------------------------ config show / fields


def test_config_show_applies_override(runner):
    res = invoke(runner, "config", "show", "--set", "rollout.group_size=4")
    assert res.exit_code == 0, res.output
    data = yaml.safe_load(res.stdout)
    assert data["rollout"]["group_size"] == 4
    assert data["rollout"]["tasks_per_step"] == 8  # the rest stays at the defaults
    assert data["algo"]["eps_low"] == DEFAULT_CLIP["gspo"][0]


def test_config_show_subprocess():
    res = cli("config", "show", "-s", "train.lr=0.003", "-s", "algo.name=grpo")
    assert res.returncode == 0, res.stderr
    data = yaml.safe_load(res.stdout)
    assert data["train"]["lr"] == 0.003
    assert (data["algo"]["eps_low"], data["algo"]["eps_high"]) == (0.2, 0.28)


def test_config_fields_describes_every_leaf(runner):
    res = invoke(runner, "config", "fields")
    assert res.exit_code == 0, res.output
    rows = describe_fields()
    keys = [key for key, _, _ in rows]
    assert len(keys) == len(set(keys)) >= 40
    assert {"model.lora.rank", "rollout.group_size", "algo.eps_low", "seed"} <= set(keys)
    lines = res.stdout.splitlines()
    for key, _default, description in rows:
        assert description.strip(), f"{key} has no description"
        assert any(
            re.search(rf"(^|\W){re.escape(key)}\s", line) and description in line for line in lines
        ), key

    # every leaf of the resolved config is described, and nothing else
    def leaves(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and k not in ("args", "env_args"):  # dict-valued fields
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"

    assert sorted(leaves(load_config().model_dump())) == sorted(keys)


# ------------------------------------------------------------------ bad configs

BAD_SETS = [
    # (overrides, substrings the message must contain)
    (["nope.x=1"], ["nope", "unknown key"]),
    (["rollout.group_sise=4"], ["rollout.group_sise", "did you mean 'group_size'"]),
    (["rollout.group_size=abc"], ["rollout.group_size", "'abc'", "integer"]),
    (["rollout.group_size=0"], ["rollout.group_size = 0", "greater than or equal to 1"]),
    (["train.lr=-1"], ["train.lr = -1", "greater than 0"]),
    (["rollout.temperature=9"], ["rollout.temperature = 9", "less than or equal to 5"]),
    (["algo.name=ppo"], ["algo.name = 'ppo'", "gspo"]),
    (["model.dtype=float8"], ["model.dtype = 'float8'", "bfloat16"]),
    (["rollout.group_size"], ["'rollout.group_size'", "section.field=value"]),
    (["=4"], ["section.field=value"]),
    (["seed=3", "seed.x=1"], ["'seed' is not a section"]),
    (["model.lora.rank=0"], ["model.lora.rank = 0", "LoRA rank"]),
    (["algo.eps_low=1.5"], ["algo.eps_low = 1.5", "less than or equal to 1"]),
    (["train.stepz=3"], ["train.stepz", "did you mean 'steps'"]),
    (["logging.tensorboard=maybe"], ["logging.tensorboard = 'maybe'", "bool"]),
]


@pytest.mark.parametrize(("sets", "needles"), BAD_SETS, ids=[" ".join(s) for s, _ in BAD_SETS])
def test_bad_override_exits_2_and_names_the_field(runner, sets, needles):
    args = [a for s in sets for a in ("--set", s)]
    res = invoke(runner, "config", "show", *args)
    assert res.exit_code == 2, res.output
    assert res.stdout == ""
    message = res.stderr
    assert message.startswith("error: ")
    for needle in needles:
        assert needle in message, (needle, message)
    assert "Traceback" not in message


@pytest.mark.parametrize(
    ("content", "needles"),
    [
        (None, ["config file not found"]),
        ("- 1\n- 2\n", ["must hold a mapping", "list"]),
        ("just a string\n", ["must hold a mapping", "str"]),
        ("rollout: {group_size: 4\n", ["is not valid YAML"]),
        ("rollout:\n  group_size: -3\n", ["rollout.group_size = -3"]),
        ("rollout: 5\n", ["rollout = 5"]),
    ],
    ids=["missing", "list", "string", "invalid-yaml", "bad-value", "section-not-mapping"],
)
def test_bad_config_file_exits_2(runner, tmp_path, content, needles):
    path = tmp_path / "cfg.yaml"
    if content is not None:
        path.write_text(content)
    res = invoke(runner, "config", "show", str(path))
    assert res.exit_code == 2, res.output
    for needle in needles:
        assert needle in res.stderr, (needle, res.stderr)
    if content is None or "mapping" in needles[0]:
        assert str(path) in res.stderr


def test_run_with_bad_config_fails_before_training(runner, tmp_path):
    res = invoke(runner, "run", "--set", "algo.name=ppo", "--out", str(tmp_path / "r"))
    assert res.exit_code == 2
    assert "algo.name = 'ppo'" in res.stderr
    assert not (tmp_path / "r").exists()


def test_run_with_a_folder_that_is_no_run_as_config(runner, tmp_path):
    res = invoke(runner, "run", str(tmp_path), "--resume")
    assert res.exit_code == 2
    assert f"{tmp_path} is a folder, not a config file" in res.stderr
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ precedence / defaults


def test_yaml_file_then_overrides(runner, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("rollout:\n  group_size: 3\n  temperature: 0.5\ntrain:\n  lr: 0.01\nseed: 7\n")
    res = invoke(
        runner, "config", "show", str(path),
        "--set", "rollout.group_size=5", "--set", "seed=9", "--set", "seed=11",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    data = yaml.safe_load(res.stdout)
    assert data["rollout"]["group_size"] == 5  # --set beats the file
    assert data["rollout"]["temperature"] == 0.5  # the file beats the defaults
    assert data["train"]["lr"] == 0.01
    assert data["seed"] == 11  # the last --set wins
    assert data["rollout"]["tasks_per_step"] == 8  # default


def test_override_values_are_yaml(tmp_path):
    cfg = load_config(
        overrides=[
            "model.lora.target_modules=[q_proj, v_proj]",
            "env.args={opponent: minimax}",
            "model.name=tiny-random",
            "eval.seed=0x10",
        ]
    )
    assert cfg.model.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.env.args == {"opponent": "minimax"}
    assert cfg.model.name == "tiny-random"
    assert cfg.eval.seed == 16


@pytest.mark.parametrize(
    ("overrides", "clip"),
    [
        ([], (3e-4, 4e-4)),
        (["algo.name=gspo"], (3e-4, 4e-4)),
        (["algo.name=gspo_token"], (3e-4, 4e-4)),
        (["algo.name=grpo"], (0.2, 0.28)),
        (["algo.name=dr_grpo"], (0.2, 0.28)),
        (["algo.name=grpo", "algo.eps_low=0.1"], (0.1, 0.28)),
        (["algo.name=gspo", "algo.eps_high=0.001"], (3e-4, 0.001)),
        (["algo.eps_low=0", "algo.eps_high=0.5", "algo.name=grpo"], (0.0, 0.5)),
    ],
)
def test_clip_defaults_per_algorithm(overrides, clip):
    algo = load_config(overrides=overrides).algo
    assert (algo.eps_low, algo.eps_high) == pytest.approx(clip)


def test_load_config_raises_config_error():
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(overrides=["rollout.nope=1"])


def test_exponent_floats_parse_as_numbers():
    from looprl.config import load_config

    cfg = load_config(None, ["train.lr=5e-4", "algo.eps_high=1E-3"])
    assert cfg.train.lr == 5e-4 and cfg.algo.eps_high == 1e-3


@pytest.mark.parametrize(
    "recipe",
    sorted((Path(__file__).resolve().parent.parent / "bench" / "learning").glob("*.yaml")),
    ids=lambda p: p.stem,
)
def test_learning_recipes_are_valid_configs(recipe):
    """Every bench/learning recipe loads (a typo in one would surface an hour into a run)."""
    cfg = load_config(recipe, [])
    assert cfg.train.steps >= 1 or cfg.sft.enabled  # an SFT-only ablation trains too


def test_make_demo_runs_the_demo_config():
    """`make demo` runs examples/demo.yaml, which loads, and whose env gives the SFT its
    demonstrations with the board view it trains on."""
    from looprl.envs import make_env
    from looprl.envs.base import demonstrations

    root = Path(__file__).resolve().parent.parent
    demo = re.search(r"^demo:.*\n\t(.+)$", (root / "Makefile").read_text(), re.M)
    assert demo and "looprl run examples/demo.yaml --out runs/demo --force" in demo.group(1)
    cfg = load_config(root / "examples" / "demo.yaml", [])
    assert cfg.sft.enabled and cfg.train.steps >= 1 and cfg.eval.greedy_runs
    env = make_env(cfg.env.name, cfg.env.args)
    (task,) = env.tasks("train", 1, 0)
    assert "Two in a line:" in env.reset(task).messages[-1].content
    assert demonstrations(env, task)  # the SFT's expert move for this board


# ------------------------------------------------------------------ config rules in the config


def test_the_rules_over_several_sections_stop_the_config_itself():
    """A rule that needs only the config fails `load_config`, before any command runs."""
    with pytest.raises(ConfigError, match="set algo.tis_cap"):
        load_config(None, ["rollout.max_staleness=1"])
    with pytest.raises(ConfigError, match="model.lora.enabled=true"):
        load_config(
            None,
            ["rollout.max_staleness=1", "algo.tis_cap=2", "rollout.engine=vllm",
             "model.lora.enabled=false"],
        )  # fmt: skip
    assert load_config(None, ["rollout.max_staleness=1", "algo.tis_cap=2"]).algo.tis_cap == 2


def test_moved_levers_read_from_the_old_spelling_with_a_warning():
    with pytest.warns(FutureWarning, match="write algo.experimental.entropy_coef"):
        cfg = load_config(None, ["algo.entropy_coef=0.2"])
    assert cfg.algo.experimental.entropy_coef == 0.2
    assert "entropy_coef" not in cfg.model_dump()["algo"]  # written in the new place only
    assert cfg.model_dump()["algo"]["experimental"]["entropy_coef"] == 0.2


def test_a_run_folder_written_before_the_move_loads_without_a_warning():
    """config.yaml of an older run holds both levers at their defaults, at algo's top."""
    old = load_config(None, []).model_dump(mode="json")
    algo = old["algo"]
    algo.update(algo.pop("experimental"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = config_from_dict(old)
    assert cfg == load_config(None, [])
