"""The `vllm` engine against a real vLLM server (its own environment, `make setup-vllm`):
the engine contract beside the `hf` engine's, weight pushes (LoRA and full), a whole
run, and a run whose server dies. One server serves the whole module (eager mode)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from looprl.chat import ChatRenderer
from looprl.engine import GenerationRequest, SamplingParams, ToolConstraint
from looprl.engine.hf import HFEngine
from looprl.types import Message
from tests.run_flags import set_flags

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("LOOPRL_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
needs_vllm = pytest.mark.skipif(
    not VLLM_PYTHON.is_file(), reason=f"no vLLM environment at {VLLM_PYTHON} (make setup-vllm)"
)
MOVE = {
    "type": "function",
    "function": {
        "name": "move",
        "parameters": {
            "type": "object",
            "properties": {"square": {"type": "integer", "minimum": 0, "maximum": 8}},
            "required": ["square"],
        },
    },
}


def looprl(*args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "looprl.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_vllm_engine_without_its_environment_is_a_config_error(tmp_path):
    out = tmp_path / "run"
    res = looprl(
        "run",
        "--set",
        "model.name=tiny-random",
        "--set",
        "rollout.engine=vllm",
        "--set",
        f"rollout.vllm_python={tmp_path / 'missing' / 'python'}",
        "--out",
        out,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert "make setup-vllm" in res.stderr
    assert not out.exists()  # nothing written


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer) -> Path:
    """The tiny random model with 32-wide heads (vLLM's CPU attention has no 16), saved
    with its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from looprl.model.load import TINY_CONFIG

    folder = tmp_path_factory.mktemp("vllm-model") / "tiny32"
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{**TINY_CONFIG, "num_attention_heads": 2, "num_key_value_heads": 1},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    from looprl.engine.vllm_server import LaunchSpec, VLLMServer

    spec = LaunchSpec(
        python=str(VLLM_PYTHON),
        model_dir=model_dir,
        dtype="float32",
        max_model_len=2048,
        lora_rank=16,
        eager=True,
        kv_cache_gb=1.0,
    )
    server = VLLMServer.start(spec, tmp_path_factory.mktemp("vllm-server"))
    yield server
    server.close()


def fresh_model(model_dir: Path, lora: bool = False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    return model.eval()


def make_engine(kind: str, model, tokenizer, renderer, server, tmp_path):
    if kind == "hf":
        return HFEngine(model, tokenizer, renderer.eos_ids)
    from types import SimpleNamespace

    from looprl.engine.vllm import VLLMEngine
    from looprl.loop.policy import policy_rescorer

    rescore = None
    if kind == "vllm-policy":  # forced calls scored by the policy module, not the server
        policy = SimpleNamespace(model=model, tokenizer=tokenizer, device=torch.device("cpu"))
        rescore = policy_rescorer(policy, budget=256)  # several passes for six requests
    engine = VLLMEngine(model, tokenizer, renderer.eos_ids, server, tmp_path, rescore)
    engine.load_weights()
    return engine


def trainer_logprobs(
    model, prompt: list[int], completion: list[int], temperature: float = 1.0
) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, -1)
    return torch.tensor([logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)])


def prompt_ids(renderer: ChatRenderer, text: str) -> list[int]:
    return renderer.prompt_ids([Message(role="user", content=text)], [MOVE])


# ---------------------------------------------------------------------------- contract


@needs_vllm
@pytest.mark.parametrize("kind", ["hf", "vllm", "vllm-policy"])
def test_engine_contract(kind, model_dir, tokenizer, renderer, server, tmp_path):
    """Seeded runs repeat; forced calls are valid calls of the tool; every logprob is
    the trainer's unconstrained one (fp32: within 1e-4), whether the server or the
    policy module (`vllm-policy`) scores the forced calls."""
    model = fresh_model(model_dir)
    engine = make_engine(kind, model, tokenizer, renderer, server, tmp_path)
    prompts = [prompt_ids(renderer, f"play square {i}") for i in range(3)]
    forced = ToolConstraint([MOVE], "required", renderer.format)
    requests = [GenerationRequest(p) for p in prompts]
    requests += [GenerationRequest(p, constraint=forced) for p in prompts]
    params = SamplingParams(max_new_tokens=80, seed=11)
    first = engine.generate(requests, params)
    again = engine.generate(requests, params)
    assert [c.ids for c in first] == [c.ids for c in again]
    other = engine.generate(requests, SamplingParams(max_new_tokens=80, seed=12))
    assert [c.ids for c in other] != [c.ids for c in first]
    for request, completion in zip(requests, first):
        assert len(completion.logprobs) == len(completion.ids) > 0
        want = trainer_logprobs(model, request.prompt_ids, completion.ids)
        torch.testing.assert_close(torch.tensor(completion.logprobs), want, rtol=0, atol=1e-4)
        if request.constraint is not None:
            text = renderer.decode(completion.ids)
            message = renderer.assistant_message(text, [MOVE], require_call=True)
            assert [call.name for call in message.tool_calls] == ["move"], text
            assert 0 <= message.tool_calls[0].arguments["square"] <= 8, text
            assert completion.finish_reason == "stop"


@needs_vllm
def test_forced_calls_at_any_temperature_with_policy_rescoring(
    model_dir, tokenizer, renderer, server, tmp_path
):
    """The server scores prompt logprobs at T = 1 only, so a forced call sampled at
    T = 0.7 needs the policy's scorer: its logprobs are those at T = 0.7."""
    from looprl.errors import EngineError

    model = fresh_model(model_dir)
    prompt = prompt_ids(renderer, "your move")
    request = GenerationRequest(
        prompt, constraint=ToolConstraint([MOVE], "required", renderer.format)
    )
    params = SamplingParams(max_new_tokens=80, seed=5, temperature=0.7)
    engine = make_engine("vllm-policy", model, tokenizer, renderer, server, tmp_path)
    completion = engine.generate([request], params)[0]
    want = trainer_logprobs(model, prompt, completion.ids, temperature=0.7)
    torch.testing.assert_close(torch.tensor(completion.logprobs), want, rtol=0, atol=1e-4)
    engine = make_engine("vllm", model, tokenizer, renderer, server, tmp_path)
    with pytest.raises(EngineError, match="vllm_rescore=policy"):
        engine.generate([request], params)


@needs_vllm
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_next_rollout_samples_from_the_updated_weights(
    lora, model_dir, tokenizer, renderer, server, tmp_path
):
    """An optimizer-like in-place change of the trainable weights reaches the server
    before the next `generate`: its logprobs are the new policy's."""
    model = fresh_model(model_dir, lora=lora)
    engine = make_engine("vllm", model, tokenizer, renderer, server, tmp_path)
    trainable = [p for n, p in model.named_parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in trainable]
    request = GenerationRequest(prompt_ids(renderer, "a move please"))
    params = SamplingParams(max_new_tokens=24, seed=3)
    before = engine.generate([request], params)[0]
    pushes = engine.pushes
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            for p in trainable:
                p.add_(torch.randn_like(p) * (0.3 if lora else 0.05))
        after = engine.generate([request], params)[0]
        assert engine.pushes == pushes + 1
        new = trainer_logprobs(model, request.prompt_ids, after.ids)
        torch.testing.assert_close(torch.tensor(after.logprobs), new, rtol=0, atol=1e-4)
        old = trainer_logprobs(fresh_model(model_dir), request.prompt_ids, after.ids)
        assert (new - old).abs().max() > 1e-2  # the update did move these logprobs
        assert after.ids != before.ids or after.logprobs != before.logprobs
    finally:
        with torch.no_grad():
            for p, value in zip(trainable, saved):
                p.copy_(value)
        engine.load_weights()  # the shared server goes back to the original weights


# ---------------------------------------------------------------------------- runs


def run_args(model_dir: Path, server, out: Path, steps: int) -> list[str | Path]:
    return [
        "run",
        "--out",
        out,
        "--set",
        f"model.name={model_dir}",
        "--set",
        "rollout.engine=vllm",
        "--set",
        f"rollout.vllm_url={server.url}",
        "--set",
        "rollout.tasks_per_step=2",
        "--set",
        "rollout.group_size=2",
        "--set",
        "rollout.max_new_tokens=48",
        "--set",
        "eval.tasks=2",
        "--set",
        "train.checkpoint_every=1",
        "--set",
        f"train.steps={steps}",
        "--set",
        "algo.tis_cap=2.0",
    ]


@needs_vllm
def test_run_with_the_vllm_engine(model_dir, server, tmp_path):
    out = tmp_path / "run"
    res = looprl(*run_args(model_dir, server, out, steps=2))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # fp32 on both sides: the engine's logprobs are the trainer's, step 2's after a push
    assert all(0 <= r["rollout/logprob_gap"] < 1e-3 for r in rows), rows
    assert (out / "report.md").is_file()


@needs_vllm
def test_overlapped_rollouts_on_the_vllm_server(model_dir, server, tmp_path):
    """rollout.max_staleness=1: a rollout thread samples step t + 1 on the server, under a
    replica's adapter of its own, while the trainer trains step t."""
    out = tmp_path / "run"
    args = [
        *run_args(model_dir, server, out, steps=3),
        "--set",
        "rollout.max_staleness=1",
        "--set",
        "model.lora.enabled=true",
    ]
    res = looprl(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1]
    assert all(r["rollout/mismatch_kl"] >= 0 for r in rows)
    assert (out / "report.md").is_file()


@needs_vllm
def test_a_vllm_served_teacher_gives_the_local_teachers_distill_kl(model_dir, tmp_path):
    """vLLM's OpenAI server as on-policy distillation's teacher (`algo.teacher: URL#NAME`,
    echoed completions): the same train/distill_kl as the same model loaded locally, on the
    same episodes of a tiny-random student. A server of its own, without LoRA (vLLM CPU's
    LoRA kernel fails now and then with several prompts in flight)."""
    from looprl.engine.vllm_server import SERVED_NAME, LaunchSpec, VLLMServer

    # the tool-call parser: the teacher's report row plays the env's forced calls by chat
    spec = LaunchSpec(
        python=str(VLLM_PYTHON),
        model_dir=model_dir,
        dtype="float32",
        max_model_len=2048,
        eager=True,
        kv_cache_gb=0.5,
        extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
    )
    (tmp_path / "teacher-server").mkdir()
    teacher = VLLMServer.start(spec, tmp_path / "teacher-server")
    opd = set_flags(
        "model.name=tiny-random",
        "algo.name=opd",
        "rollout.tasks_per_step=2",
        "rollout.group_size=2",
        "eval.tasks=2",
        "eval.greedy=false",
        "train.steps=1",
        "logging.trackers=[]",
    )
    try:
        runs = {
            "local": str(model_dir),
            "served": f"{teacher.url}/v1#{SERVED_NAME}",
        }
        rows = {}
        for name, spec_ in runs.items():
            out = tmp_path / name
            res = looprl("run", *opd, "--set", f"algo.teacher={spec_}", "--out", out)
            assert res.returncode == 0, res.stderr[-3000:]
            rows[name] = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    finally:
        teacher.close()
    local, served = rows["local"], rows["served"]
    assert local["rollout/rewards_mean"] == served["rollout/rewards_mean"]
    assert abs(local["train/distill_kl"]) > 1e-3
    assert served["train/distill_kl"] == pytest.approx(local["train/distill_kl"], abs=1e-4)
    for name in runs:  # the teacher's held-out row, played locally and through the server
        kept = json.loads((tmp_path / name / "eval" / "teacher.json").read_text())
        final = json.loads((tmp_path / name / "eval" / "final.json").read_text())
        assert kept["n"] == final["n"] == 8 and kept["task_ids"] == final["task_ids"]


@needs_vllm
def test_a_sharded_run_pushes_to_the_server(model_dir, server, tmp_path):
    """train.shard=fsdp (full fine-tuning) over two gloo processes sharing the server by
    URL: each rank pushes the weights from its shards, every tensor gathered in turn (at
    most one at a time, as each rank reports), and the server samples the trainer's
    weights: after the final eval's push its logprobs are those of the last checkpoint.
    The server's own weights are put back afterwards."""
    import socket

    out = tmp_path / "run"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    torchrun += ["--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "looprl"]
    args = [*torchrun, *run_args(model_dir, server, out, steps=2)]
    args += ["--set", "train.shard=fsdp", "--set", "eval.greedy=false"]
    args += ["--set", "model.lora.enabled=false"]
    # rewards that differ within a group, and steps that move the logprobs: a stale push
    # would show
    args += ["--set", "env.name=dist_env:ChecksumEnv", "--set", "train.lr=0.01"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    try:
        res = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
        assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        assert rows[0]["train/grad_norm"] > 0 and rows[0]["train/zero_std_groups"] < 2, rows
        assert_server_samples(server, out, "step_000002", other="step_000001")
    finally:  # the module's server serves the saved model again
        body = {"method": "looprl_load_weights", "args": [str(model_dir / "model.safetensors")]}
        server.post("/collective_rpc", body)
        server.post("/reset_prefix_cache", {})
    notes = re.findall(
        r"rank (\d): weights pushed from shards, (\d+) tensors gathered in turn, at most "
        r"([\d,]+) bytes at once of ([\d,]+)",
        res.stderr,
    )
    assert sorted(int(rank) for rank, *_ in notes) == [0, 1], res.stderr[-3000:]
    for _, tensors, peak, total in notes:
        peak, total = int(peak.replace(",", "")), int(total.replace(",", ""))
        assert int(tensors) > 2 and 0 < peak < total


def assert_server_samples(server, run: Path, checkpoint: str, other: str) -> None:
    """The server samples with `checkpoint`'s weights (float32: within 1e-4), and
    `other`'s weights give other logprobs (so a stale push would show)."""
    from looprl.config import load_config
    from looprl.engine.vllm_server import SERVED_NAME
    from looprl.loop.checkpoint import load_weights
    from looprl.loop.policy import load_policy

    policy = load_policy(load_config(run / "config.yaml", ["model.device=cpu"]))
    prompt = prompt_ids(policy.renderer, "say a number")
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 1.0}
    body |= {"seed": 0, "logprobs": 0, "return_token_ids": True}
    choice = server.post("/v1/completions", body)["choices"][0]
    ids, served = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    load_weights(policy.model, run / "checkpoints" / other)
    before = trainer_logprobs(policy.model.eval(), prompt, ids)
    load_weights(policy.model, run / "checkpoints" / checkpoint)
    after = trainer_logprobs(policy.model, prompt, ids)
    torch.testing.assert_close(torch.tensor(served), after, rtol=0, atol=1e-4)
    assert (after - before).abs().max() > 1e-2


@needs_vllm
def test_a_dead_server_stops_the_run_with_a_checkpoint_and_resume(model_dir, server, tmp_path):
    """Runs last: it kills the module's server. The run stops with the state of its last
    whole step checkpointed and the resume command; `--resume` continues (here on the
    hf engine, as the server is gone)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "looprl.cli", *map(str, run_args(model_dir, server, out, 3))]
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and run.poll() is None:
        if metrics.is_file() and metrics.read_text().strip():
            break
        time.sleep(0.5)
    assert run.poll() is None, run.communicate()[1][-3000:]
    os.killpg(server.process.pid, signal.SIGKILL)
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 2, stderr[-3000:]
    assert "vLLM server" in stderr and f"looprl run --out {out} --resume" in stderr
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert (out / "checkpoints" / f"step_{steps[-1]:06d}").is_dir()
    res = looprl(
        "run",
        "--out",
        out,
        "--resume",
        "--set",
        "rollout.engine=hf",
        "--set",
        f"model.name={model_dir}",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert rows == [1, 2, 3]
