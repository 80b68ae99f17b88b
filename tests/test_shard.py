"""train.shard=fsdp: two sharded processes (torchrun, gloo, FSDP2) against one whole
process on the same episodes, for a dense model and an MoE one: the first gradient, the
losses and the weights after two updates agree, while each rank holds half the
parameters, gradients and optimizer state (the tensors' local shards, measured); the
ranks run different numbers of micro-batches and still meet in every collective.
Checkpoints written sharded (each rank its own shards, torch.distributed.checkpoint) read
back as those written whole, at 1 -> 1, 1 -> 2, 2 -> 2 and 2 -> 1 processes, and export
to the same safetensors; a sharded run resumes on one process and on two; a save cut
short leaves no checkpoint; a rank that fails stops the job; the combinations sharding
does not support are refused at config load.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
from test_distributed import (
    TORCHRUN,
    assert_same_step,
    free_port,
    launch,
    metrics,
    one_node,
    one_process,
    run_args,
)

from looprl.config import load_config
from looprl.errors import ConfigError
from looprl.loop.checkpoint import list_checkpoints, save_checkpoint
from looprl.loop.dist import Dist
from looprl.loop.shard import decoder_layers, shard_policy
from looprl.model.tiny import save_tiny

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "shard_worker.py")
SHARDED = ["train.shard=fsdp", "model.lora.enabled=true", "eval.greedy=false"]


def run_worker(out: Path, mode: str, model: str, processes: int) -> tuple[dict, list[dict]]:
    """The worker on MODEL (comma-separated: several models, in one launch): the first
    model's result and each rank's memory."""
    out.mkdir(parents=True)
    cmd = [sys.executable, WORKER, str(out), mode, model]
    if processes > 1:
        cmd = [
            *TORCHRUN,
            "--nproc_per_node",
            str(processes),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            WORKER,
            str(out),
            mode,
            model,
        ]
    proc = launch(cmd)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    return worker_result(out, processes)


def worker_result(out: Path, processes: int) -> tuple[dict, list[dict]]:
    memory = [json.loads((out / f"memory_{r}.json").read_text()) for r in range(processes)]
    return torch.load(out / "result.pt"), memory


# updated in the same launches as qwen3_moe: MLA attention, grouped routing, shared experts
MORE_MOE = ("deepseek_v3", "glm4_moe")


@pytest.mark.parametrize(
    ("mode", "arch"), [("lora-checkpointed-kl", "llama"), ("full-every", "moe")]
)
def test_two_sharded_processes_update_like_one(tmp_path, mode, arch):
    """LoRA with gradient checkpointing (each layer recomputed under FSDP2's hooks) and a
    KL term to the base model (the adapters switched off on whole weights), the gradients
    reduced after the last micro-batch, on tiny-random (llama); and a full fine-tune (the
    root's embeddings and norm trained too) of a tiny qwen3_moe model (routers, experts,
    q/k norms sharded), reduced after every micro-batch, and in the same launches of
    tiny deepseek_v3 (MLA: low-rank queries, a compressed key/value latent, value heads
    narrower than the keys; grouped routing, a shared expert, a dense first layer) and
    glm4_moe (sigmoid routing, a shared expert, partial rotary, q/k/v biases)."""
    model, more = "tiny-random", []
    if arch == "moe":
        model = str(save_tiny("qwen3_moe", tmp_path / "qwen3_moe"))
        more = [str(save_tiny(name, tmp_path / name)) for name in MORE_MOE]
    whole, (one,) = run_worker(tmp_path / "one", mode, ",".join([model, *more]), 1)
    sharded, ranks = run_worker(tmp_path / "two", mode, ",".join([model, *more]), 2)
    checkpointed = "-checkpointed" in mode
    assert_updates_alike(whole, sharded, one, ranks, checkpointed)
    assert_checkpoints_resume_alike(tmp_path, whole, sharded)
    assert_warm_start_and_anchor_alike(whole, sharded)
    for name in MORE_MOE if more else ():
        (whole, (one,)), (sharded, ranks) = (
            worker_result(tmp_path / job / name, processes)
            for job, processes in (("one", 1), ("two", 2))
        )
        assert_updates_alike(whole, sharded, one, ranks, checkpointed)


def assert_updates_alike(
    whole: dict, sharded: dict, one: dict, ranks: list[dict], checkpointed: bool
) -> None:
    """The same losses, norms and first gradient (1e-5) and the same weights after the
    updates (1e-4); each rank holds half of what one process holds, the idle passes run,
    and the sharded logprobs come from the head apart (loss positions only)."""
    for a, b in zip(whole["stats"], sharded["stats"]):
        assert a["updated"] == b["updated"] == 2
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert whole["grads"].keys() == sharded["grads"].keys()
    for name, grad in whole["grads"].items():
        assert torch.allclose(sharded["grads"][name], grad, atol=1e-5, rtol=0), name
    assert any(g.abs().max() > 1e-3 for g in whole["grads"].values())  # a real gradient
    for name, weight in whole["weights"].items():
        assert torch.allclose(sharded["weights"][name], weight, atol=1e-4, rtol=0), name
    # each rank holds half of what one process holds, and together all of it
    for part in ("params", "trainable", "grads", "optimizer"):
        assert sum(r[part] for r in ranks) == one[part], part
        assert all(r[part] <= 0.51 * one[part] for r in ranks), part
    # the ranks' episodes differ in length: different micro-batch counts, padded
    assert one["idle_passes"] == 0 and ranks[1]["idle_passes"] > ranks[0]["idle_passes"]
    assert all(bool(r["checkpointed"]) == checkpointed for r in [one, *ranks])
    # sharded, the body and the head run apart inside the root's forward (forward/score.py)
    assert all(r["root_calls"] for r in ranks) and not one["root_calls"]


def assert_warm_start_and_anchor_alike(whole: dict, sharded: dict) -> None:
    """An SFT step (each rank its share of the episodes), then with a KL term an update
    anchored to the weights as they were then (algo.kl_reference=start, each rank keeping
    its shards, the reference read back as a resumed run reads it): as on one process."""
    assert sharded["sft_loss"] == pytest.approx(whole["sft_loss"], rel=1e-5)
    for name, weight in whole["after_sft"].items():
        assert torch.allclose(sharded["after_sft"][name], weight, atol=1e-4, rtol=0), name
    assert any(not torch.equal(w, whole["weights"][n]) for n, w in whole["after_sft"].items())
    if "anchored" not in whole:
        return
    for job in (whole, sharded):
        for name, weight in job["after_sft"].items():
            assert torch.equal(job["kept"][name], weight), name
            assert torch.equal(job["reread"][name], weight), name
    assert whole["kl"] > 0 and sharded["kl"] == pytest.approx(whole["kl"], rel=1e-4)
    for name, weight in whole["anchored"].items():
        assert torch.allclose(sharded["anchored"][name], weight, atol=1e-4, rtol=0), name


def assert_same_state(a: dict, b: dict) -> None:
    assert a["weights"].keys() == b["weights"].keys()
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for part in ("weights", "optimizer"):
        for name, tensor in a[part].items():
            assert torch.allclose(b[part][name], tensor, atol=1e-6, rtol=0), (part, name)
    assert a["lr"] == b["lr"]


def assert_checkpoints_resume_alike(tmp_path: Path, whole: dict, sharded: dict) -> None:
    """Each job checkpointed its state sharded (each rank its own shards) and whole, and
    read back every checkpoint of both jobs: the sharded one gives what the whole one
    gives, 1 -> 1, 1 -> 2 and 2 -> 2; here, on one process, 2 -> 1; and the two export to
    the same safetensors."""
    from safetensors.torch import load_file
    from shard_worker import read_back

    from looprl.loop.checkpoint import export_model

    two = tmp_path / "two"
    assert (two / "sharded/checkpoints/step_000003/sharded/__1_0.distcp").is_file()
    assert not (two / "sharded/checkpoints/step_000003/trainable.safetensors").exists()
    cfg = load_config(two / "whole" / "config.yaml", [])
    on_one = read_back([two], cfg, Dist())
    for got, job in (
        (whole["resumed"], "one"),
        (sharded["resumed"], "one"),
        (sharded["resumed"], "two"),
        (on_one, "two"),
    ):
        assert_same_state(got[f"{job}/whole"], got[f"{job}/sharded"])
        live = (whole if job == "one" else sharded)["weights"]
        assert_same_state({**got[f"{job}/whole"], "weights": live}, got[f"{job}/sharded"])
    moments = sharded["resumed"]["two/sharded"]["optimizer"]
    assert any(v.abs().max() > 0 for k, v in moments.items() if k.endswith("exp_avg"))
    exported = [
        export_model(two / kind, tmp_path / f"export-{kind}") for kind in ("sharded", "whole")
    ]
    files = [load_file(str(folder / "model.safetensors")) for folder in exported]
    assert files[0].keys() == files[1].keys()
    assert all(torch.equal(files[0][k], files[1][k]) for k in files[0])


def test_sharded_checkpoints_resume_at_another_world_size(tmp_path):
    """A sharded run with an SFT warm start, anchored to it by default (a KL term to the
    weights the RL steps start from, algo.kl_reference=start), and its sharded checkpoints
    (each rank writes its own shards; the held-out curve's best weights and the RL
    start's too): 2 sharded -> 1 and -> 2 sharded give the same third step, each reading
    the RL start's shards back. 1 -> 2 and the whole layout are read back in
    test_two_sharded_processes_update_like_one."""
    sharded = tmp_path / "sharded"
    warm = ["sft.enabled=true", "sft.steps=1", "sft.batch_size=4", "eval.every=1"]
    one_node(sharded, *SHARDED, *warm)
    assert load_config(sharded / "config.yaml", []).algo.kl_reference == "start"
    assert (sharded / "eval" / "after_sft.json").is_file()
    assert_best_and_start_sharded(sharded, tmp_path)
    last = sharded / "checkpoints" / "step_000002"
    assert (last / "sharded" / "__1_0.distcp").is_file() and (last / "meta.json").is_file()
    on_one, on_two = tmp_path / "on_one", tmp_path / "on_two"
    shutil.copytree(sharded, on_one)
    shutil.copytree(sharded, on_two)
    one_process(on_one, *SHARDED, "train.steps=3", resume=True)  # one process: whole
    one_node(on_two, *SHARDED, "train.steps=3", resume=True)
    assert [m["step"] for m in metrics(on_one)] == [1, 2, 3]
    assert_same_step(on_one, on_two, 3)


def assert_best_and_start_sharded(run: Path, tmp_path: Path) -> None:
    """`checkpoints/best` (eval.every) and `checkpoints/rl_start` are each rank's shards;
    best holds the weights of its step, and exports to the same safetensors as a whole
    folder of those weights."""
    from safetensors.torch import load_file

    from looprl.loop.checkpoint import checkpoint_weights, export_model, write_weights

    best, start = run / "checkpoints" / "best", run / "checkpoints" / "rl_start"
    for folder in (best, start):
        assert (folder / "sharded" / "__1_0.distcp").is_file(), folder
        assert not (folder / "trainable.safetensors").exists(), folder
    meta = json.loads((best / "meta.json").read_text())
    same = start if meta["step"] == 0 else run / "checkpoints" / f"step_{meta['step']:06d}"
    weights = checkpoint_weights(same)
    assert checkpoint_weights(best).keys() == weights.keys()
    assert all(torch.equal(checkpoint_weights(best)[k], w) for k, w in weights.items())
    whole = write_weights(tmp_path / "whole-best", weights, meta)
    files = [
        load_file(str(export_model(run, tmp_path / f"best-{name}", folder) / "model.safetensors"))
        for name, folder in (("sharded", best), ("whole", whole))
    ]
    assert files[0].keys() == files[1].keys()
    assert all(torch.equal(files[0][k], files[1][k]) for k in files[0])


def test_an_interrupted_sharded_save_leaves_no_checkpoint(tmp_path):
    """A save that fails after the shards are written (here: its meta.json cannot be
    written) leaves a `.tmp-` folder no reader lists; the next save removes it."""
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    save = partial(save_checkpoint, tmp_path, model=model, optimizer=optimizer)
    save(step=1, scheduler=scheduler, extra={}, keep=3, sharded=True)
    with pytest.raises(TypeError):
        save(step=2, scheduler=scheduler, extra={"unwritable": object()}, keep=3, sharded=True)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000001"]
    (leftover,) = (tmp_path / "checkpoints").glob(".tmp-*")
    assert (leftover / "sharded" / ".metadata").is_file()  # the shards were written
    save(step=3, scheduler=scheduler, extra={}, keep=3, sharded=True)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000001", "step_000003"]


def test_a_failing_sharded_rank_stops_the_job(tmp_path):
    cmd = [
        *TORCHRUN,
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        *run_args(tmp_path / "run", *SHARDED),
    ]
    proc = launch(cmd, LOOPRL_TEST_FAIL_RANK="1")
    output, _ = proc.communicate(timeout=240)
    ended = time.time()
    assert proc.returncode != 0
    match = re.search(r"rank 1 fails on purpose at ([0-9.]+)", output)
    assert match, output[-4000:]
    assert ended - float(match.group(1)) < 60  # not a hang until a timeout


@pytest.mark.parametrize(
    ("sets", "names"),
    [
        (["train.optimizer=adamw_8bit"], "train.optimizer=adamw_8bit"),
        (["rollout.sampler_dtype=bfloat16"], "rollout.sampler_dtype"),
    ],
)
def test_what_sharding_does_not_support_is_refused_at_load(sets, names):
    if "adamw_8bit" in sets[0]:
        pytest.importorskip("bitsandbytes")
    with pytest.raises(ConfigError, match=re.escape(names)):
        load_config(None, ["train.shard=fsdp", *sets])


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return LlamaForCausalLM(config)


def test_offload_needs_sharding_and_a_gpu():
    with pytest.raises(ConfigError, match="train.shard=fsdp as well"):
        load_config(None, ["train.offload=true"])
    cfg = load_config(None, ["train.shard=fsdp", "train.offload=true"])
    model = tiny_llama()
    with pytest.raises(ConfigError, match="train.offload=false"):
        shard_policy(model, cfg.train, torch.device("cpu"), Dist(rank=0, world=2))


def test_one_process_keeps_the_model_whole_and_layers_are_found():
    cfg = load_config(None, ["train.shard=fsdp"])
    model = tiny_llama()
    assert decoder_layers(model) is model.model.layers
    assert not shard_policy(model, cfg.train, torch.device("cpu"), Dist())
    assert not any(hasattr(p, "to_local") for p in model.parameters())


def test_the_plan_of_one_sharded_rank():
    """One rank of 2: the weights, adapters and optimizer state halve; a rollout phase
    holds the whole weights once more; the update holds the root and two layers whole,
    the whole-sequence logits, and the gradients whole when they accumulate over several
    micro-batches; a run that does not fit is told to shard."""
    from test_plan import hand_shape, hand_work

    from looprl.plan.devices import device
    from looprl.plan.fit import full_plan
    from looprl.plan.memory import HEAD_COPIES
    from looprl.plan.sharding import plan_for

    cfg = load_config(None, ["model.lora.enabled=false", "train.shard=fsdp"])
    shape, work, cpu = hand_shape(), hand_work(), device("cpu-24g")
    one, rank = plan_for(cfg, shape, work, cpu, 1), plan_for(cfg, shape, work, cpu, 2)
    for key in ("weights", "optimizer state"):
        assert rank.persistent.components[key] == one.persistent.components[key] / 2
    rollout = {p.name: p for p in rank.phases}["rollout"]
    assert rollout.components["whole weights"] == shape.params * 4
    update = {p.name: p for p in rank.phases}["update"]
    assert update.components["root weights whole"] == shape.embedding_params * 4
    assert update.components["layers in flight"] == 2 * (shape.params - 100_000) / 2 * 4
    assert update.components["gradients"] == shape.params * 4 / 2  # one micro-batch
    # the head apart at the loss positions only (this rank's 8 episodes × 10), not the
    # [tokens, vocab] logits of whole sequences
    assert update.components["logits"] == 8 * 10 * shape.vocab * 4 * HEAD_COPIES
    several = load_config(
        None, ["model.lora.enabled=false", "train.shard=fsdp", "train.micro_batch_tokens=64"]
    )
    update = {p.name: p for p in plan_for(several, shape, work, cpu, 2).phases}["update"]
    assert update.components["gradients"] == shape.params * 4  # whole until the last
    every = several.model_copy(
        update={"train": several.train.model_copy(update={"shard_grad_sync": "every"})}
    )
    update = {p.name: p for p in plan_for(every, shape, work, cpu, 2).phases}["update"]
    assert update.components["gradients"] == shape.params * 4 / 2
    big = replace(shape, params=2_000_000_000, embedding_params=100_000_000)
    whole = full_plan(load_config(None, ["model.lora.enabled=false"]), big, work, cpu)
    assert not whole["fits"]
    sharding = [item for item in whole["advice"] if item["set"].startswith("train.shard=fsdp")]
    assert sharding and sharding[0]["peak_bytes"] < whole["peak_bytes"]


def test_plan_command_for_one_sharded_rank():
    from typer.testing import CliRunner

    from looprl.cli import app

    runner = CliRunner(env={"COLUMNS": "250", "NO_COLOR": "1"})
    base = ["plan", "--set", "model.name=tiny-random", "--set", "model.lora.enabled=false"]
    one = json.loads(runner.invoke(app, [*base, "--json"]).output)
    res = runner.invoke(app, [*base, "--world-size", "2", "--shard", "fsdp", "--json"])
    assert res.exit_code == 0, res.output
    rank = json.loads(res.output)
    assert (rank["world_size"], rank["shard"]) == (2, "fsdp")
    assert rank["persistent"]["weights"] == one["persistent"]["weights"] / 2
    shown = runner.invoke(app, [*base, "--world-size", "2", "--shard", "fsdp"])
    assert "one rank of 2, sharded" in shown.output and "whole weights" in shown.output
    bad = runner.invoke(app, [*base, "--shard", "zero3"])
    assert bad.exit_code != 0 and "train.shard" in bad.output
