"""Bad `looprl run` invocations exit 2 with a message naming the problem, and write or
overwrite nothing. Security defaults: no eval/exec of model output, no remote code
unless asked."""

from __future__ import annotations

import ast
from pathlib import Path

import huggingface_hub.constants
import pytest
from typer.testing import CliRunner

from looprl.cli import app

TINY = ["--set", "model.name=tiny-random", "--set", "train.steps=1", "--set", "eval.tasks=1"]

BAD_RUNS = [
    # (extra args, substrings of the message)
    (["--set", "env.name=checkers"], ["unknown environment 'checkers'", "tictactoe-move"]),
    (
        ["--set", "env.name=tictactoe-game", "--set", "env.args={opponent: god}"],
        ["opponent", "god"],
    ),
    (["--set", "env.args={no_such_arg: 1}"], ["no_such_arg"]),
    (["--set", "env.name=no_such_module:Env"], ["cannot import environment module"]),
    (["--set", "env.name=toy_envs:Nope"], ["has no attribute 'Nope'"]),
    (["--set", "env.name=json:JSONDecoder"], ["is not an environment"]),
    (["--set", "model.name=./no/such/model"], ["model folder not found"]),
    (["--set", "model.name=gguf:/no/such/file.gguf"], ["GGUF file not found"]),
    (["--set", "model.name=nobody/no-such-model-xyz"], ["cannot load model", "tiny-random"]),
    (
        ["--set", "model.name=smollm2-135"],
        ["unknown model 'smollm2-135'", "did you mean 'smollm2-135m'"],
    ),
    (["--set", "model.tool_prompt=native"], ["ignores tools", "fallback"]),
    (["--set", "rollout.group_size=-2"], ["rollout.group_size = -2"]),
    (["--set", "train.steps=-1"], ["train.steps = -1"]),
    (["--set", "train.lr=fast"], ["train.lr = 'fast'"]),
    (["--set", "algo.kl_coef=0.1", "--set", "model.lora.enabled=false"], ["kl_coef"]),
    (["--set", "eval.tasks=0"], ["eval.tasks = 0"]),
    (["--set", "algo.turn_reward_weight=0.5"], ["turn_reward_weight", "gspo_turn"]),
    (
        ["--set", "algo.name=gspo_turn", "--set", "algo.turn_reward_weight=0.5"],
        ["turn_reward_weight", "move_rewards=true"],
    ),
    (
        ["--set", "env.name=tictactoe-game", "--set", "env.args={move_rewards: maybe}"],
        ["move_rewards='maybe'"],
    ),
    (["--set", "algo.loss_on=digits"], ["algo.loss_on", "'all' or 'free'"]),
    (
        [
            "--set",
            "env.name=tictactoe-game",
            "--set",
            "sft.enabled=true",
            "--set",
            "sft.env_args={agent_plays: Z}",
        ],
        ["sft.env_args", "agent_plays='Z'"],
    ),
    (
        ["--set", "algo.experimental.entropy_coef=-0.1"],
        ["algo.experimental.entropy_coef = -0.1"],
    ),
    (
        ["--set", "env.name=tictactoe-game", "--set", "env.args={opponent: 'mix:minimax=0.7'}"],
        ["mix:minimax=0.7", "add up to 1"],
    ),
    (["--set", "algo.expert_samples=8"], ["algo.expert_samples=8", "rollout.group_size=8"]),
    (["--set", "algo.greedy_samples=2"], ["algo.greedy_samples = 2"]),
    (
        ["--set", "algo.expert_samples=7", "--set", "algo.greedy_samples=1"],
        ["algo.greedy_samples=1", "rollout.group_size=8"],
    ),
    (
        ["--set", "algo.expert_samples=1", "--set", "algo.experimental.entropy_coef=0.1"],
        ["algo.expert_samples", "algo.experimental.entropy_coef"],
    ),
    (
        ["--set", "env.name=toy_envs:PickSevenAgent", "--set", "algo.expert_samples=1"],
        ["algo.expert_samples needs demonstrations", "PickSevenAgent"],
    ),
    (
        ["--set", "algo.experimental.expert_baseline=samples"],
        ["algo.experimental.expert_baseline=samples", "algo.expert_samples > 0"],
    ),
    (
        ["--set", "algo.experimental.expert_baseline=mean"],
        ["algo.experimental.expert_baseline", "'group' or 'samples'"],
    ),
    (
        ["--set", "algo.entropy_coef=0.1", "--set", "algo.experimental.entropy_coef=0.2"],
        ["algo.entropy_coef and algo.experimental.entropy_coef are the same lever"],
    ),
    (
        ["--set", "rollout.max_staleness=1", "--set", "algo.tis_cap=null"],
        ["rollout.max_staleness=1", "set algo.tis_cap"],
    ),
    (
        [
            "--set",
            "rollout.max_staleness=1",
            "--set",
            "algo.tis_cap=2",
            "--set",
            "rollout.engine=vllm",
            "--set",
            "rollout.vllm_url=http://127.0.0.1:9",
            "--set",
            "model.lora.enabled=false",
        ],
        ["rollout.max_staleness > 0 with rollout.engine=vllm", "model.lora.enabled=true"],
    ),
    (["--set", "model.device=cuda"], ["no CUDA device"]),
    (["no-such-config.yaml"], ["config file not found"]),
]


@pytest.fixture()
def runner(monkeypatch):
    # an unknown hub id must fail fast, offline: huggingface_hub reads the variable once,
    # when it is imported (earlier tests have imported it), so its constant is set as well
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return CliRunner()


@pytest.mark.parametrize(("args", "needles"), BAD_RUNS, ids=[" ".join(a) for a, _ in BAD_RUNS])
def test_bad_run_exits_2_and_writes_nothing(runner, tmp_path, args, needles):
    if "model.device=cuda" in args and __import__("torch").cuda.is_available():
        pytest.skip("a CUDA device is present")
    out = tmp_path / "run"
    res = runner.invoke(app, ["run", *TINY, *args, "--out", str(out)])
    assert res.exit_code == 2, (res.exit_code, res.output)
    for needle in needles:
        assert needle in res.stderr, (needle, res.stderr)
    assert "Traceback" not in res.output
    assert not out.exists()


def test_existing_run_folder_is_left_alone(runner, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("precious\n")
    res = runner.invoke(app, ["run", *TINY, "--out", str(out)])
    assert res.exit_code == 2
    assert "--resume" in res.stderr and "--force" in res.stderr
    assert (out / "metrics.jsonl").read_text() == "precious\n"
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


@pytest.mark.parametrize("kind", ["file", "under-a-file"])
def test_unusable_out_path(runner, tmp_path, kind):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    out = blocker if kind == "file" else blocker / "run"
    res = runner.invoke(app, ["run", *TINY, "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert "blocker" in res.stderr
    assert blocker.read_text() == "x"


def test_resume_of_a_folder_that_is_not_a_run(runner, tmp_path):
    res = runner.invoke(app, ["run", *TINY, "--out", str(tmp_path), "--resume"])
    assert res.exit_code == 2
    assert "not a run folder" in res.stderr


def test_no_eval_or_exec_anywhere_in_looprl():
    root = Path(__import__("looprl").__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in {"eval", "exec"}:
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


def test_remote_code_only_when_the_config_says_so(monkeypatch):
    import transformers

    import looprl.model.load as models

    seen = []

    def fake(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        raise OSError("stop here")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake)
    for flag in (False, True):
        with pytest.raises(models.ModelError):
            models.load_causal_lm("someone/some-model", dtype=None, trust_remote_code=flag)
    assert seen == [False, True]
