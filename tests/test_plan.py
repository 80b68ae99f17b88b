"""`looprl plan`: the memory arithmetic on a hand-checked shape, parameter counts from the
meta device against real models, and the command line on tiny-random."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from looprl.cli import app
from looprl.config import config_from_dict
from looprl.model.load import load_causal_lm
from looprl.plan.devices import device
from looprl.plan.fit import largest
from looprl.plan.memory import (
    FRAMEWORK_CPU,
    HEAD_CHUNK,
    HEAD_COPIES,
    JUMP_COPIES,
    LORA_LIBRARY,
    SAMPLING_COPIES,
    plan_memory,
)
from looprl.plan.shape import ModelShape, model_shape
from looprl.plan.workload import Workload

LING = Path(__file__).parent.parent / "examples" / "models" / "ling-3.0-tiny-class"


def hand_shape() -> ModelShape:
    """A Llama-like shape with round numbers: H = 100, 2 layers, MLP 300, vocab 1000."""
    return ModelShape(
        name="hand", model_type="llama", params=1_000_000, expert_params=0,
        active_params=1_000_000, embedding_params=100_000, lora_params=10_000,
        small_params=1_000, lora_small_params=2_000, lora_linears_per_layer=7, layers=2,
        hidden=100, vocab=1000, mlp_width=300, attention_width=200, kv_per_token=400,
        state_per_row=0, cascade=True,
    )  # fmt: skip


def hand_work() -> Workload:
    return Workload(prompt_tokens=50, head_tokens=30, response_tokens=10, forced_tokens=4,
                    turns=1, tokenizer="hand")  # fmt: skip


def test_memory_arithmetic_on_a_hand_checked_shape():
    cfg = config_from_dict({
        "rollout": {"tasks_per_step": 4, "group_size": 2, "batch_size": 6},
        "algo": {"num_minibatches": 2},
        "train": {"micro_batch_tokens": 100},
        "eval": {"tasks": 2, "samples_per_task": 2},
        "model": {"lora": {"rank": 8}},
    })  # fmt: skip
    plan = plan_memory(cfg, hand_shape(), hand_work(), device("cpu-24g"))
    every = plan.persistent.components
    assert every["framework"] == FRAMEWORK_CPU + LORA_LIBRARY
    assert every["weights"] == 1_000_000 * 4  # float32 on a CPU
    assert every["LoRA adapters"] == 10_000 * 4
    assert every["optimizer state"] == 2 * 10_000 * 4  # AdamW: m and v in float32
    assert "snapshot opponent" not in every
    eval_, rollout, update, greedy = (p.components for p in plan.phases)
    # rollout: 8 episodes, 6 rows; each row's own columns: 50 - 30 (head) + 10 = 30
    assert rollout["KV cache"] == (6 * 30 + 30) * 400 * 4
    # the forced call's 4 tokens in one pass: the logits of the 3 after the first, for
    # every row (6 x 3 positions, under FORCED_LOGIT_ROWS)
    assert rollout["logits"] == 1000 * 4 * (6 * SAMPLING_COPIES + JUMP_COPIES * 6 * 3)
    # 6 rows of groups of 2: 3 distinct prompts' tails of 20 tokens, width 4H + 3M + attn
    assert rollout["prefill"] == 3 * 20 * (400 + 900 + 200) * 4
    assert eval_["KV cache"] == (4 * 30 + 30) * 400 * 4  # 4 eval episodes < batch size
    assert eval_["prefill"] == 2 * 20 * (400 + 900 + 200) * 4  # 2 tasks × 2 samples
    # the greedy eval (eval.greedy, on by default): as many tasks as the sampled eval has
    # episodes (2 × 2), one episode each, each row its own prompt to prefill
    assert greedy["KV cache"] == (4 * 30 + 30) * 400 * 4
    assert greedy["prefill"] == 4 * 20 * (400 + 900 + 200) * 4
    more = config_from_dict({**cfg.model_dump(), "eval": {"tasks": 2, "greedy_tasks": 5}})
    wider = plan_memory(more, hand_shape(), hand_work(), device("cpu-24g")).phases[3]
    assert wider.components["prefill"] == 5 * 20 * (400 + 900 + 200) * 4  # 5 rows < 6
    off = config_from_dict({**cfg.model_dump(), "eval": {"tasks": 2, "greedy": False}})
    assert [
        p.name for p in plan_memory(off, hand_shape(), hand_work(), device("cpu-24g")).phases
    ] == ["eval", "rollout", "update"]
    # a minibatch is 2 groups × 2 episodes; the trainer's budget counts whole prompts:
    # 50 + 2 × 10 = 70 for one group, 100 + 4 × 10 = 140 > 100 for two: one group per
    # micro-batch, through the model 30 (head) + 20 (tail) + 2 × 10 = 70 tokens
    width = 6 * 100 + 200 + 4 * 300 + 7 * 8  # LoRA: rank 8 in 7 layers
    assert update["activations"] == 70 * 2 * width * 4
    assert update["gradients"] == 10_000 * 4
    assert update["logits"] == 20 * 1000 * 4 * HEAD_COPIES  # 20 loss positions < chunk
    assert HEAD_CHUNK == 256
    name, peak = plan.peak()
    assert peak == plan.persistent.total + max(p.total for p in plan.phases)
    assert name == max(plan.phases, key=lambda p: p.total).name


def test_8bit_adamw_and_full_fine_tuning_arithmetic():
    shape, work, cpu = hand_shape(), hand_work(), device("cpu-24g")
    full = config_from_dict({"model": {"lora": {"enabled": False}}})
    eight = config_from_dict(
        {"model": {"lora": {"enabled": False}}, "train": {"optimizer": "adamw_8bit"}}
    )
    full_plan, eight_plan = (
        plan_memory(full, shape, work, cpu),
        plan_memory(eight, shape, work, cpu),
    )
    assert full_plan.persistent.components["optimizer state"] == 2 * 1_000_000 * 4
    # 8-bit: 1 + 1 byte and two float32 scales per 256 values; small tensors 2 × 4 bytes
    want = (1_000_000 - 1_000) * (2 + 8 / 256) + 1_000 * 8
    assert eight_plan.persistent.components["optimizer state"] == want
    assert full_plan.phases[2].components["gradients"] == 1_000_000 * 4
    bf16 = plan_memory(full, shape, work, device("h200"))  # dtype auto on a GPU
    assert bf16.persistent.components["weights"] == 1_000_000 * 2


def test_cpu_update_holds_one_earlier_micro_batch_of_freed_blocks():
    """On a CPU the update's peak adds the blocks glibc keeps from an earlier micro-batch
    (its saved activations and backward temporaries), less what the gradients and the
    optimizer state refill; a GPU's allocator is not glibc."""
    cfg = config_from_dict({
        "rollout": {"tasks_per_step": 4, "group_size": 2}, "algo": {"num_minibatches": 2},
        "train": {"micro_batch_tokens": 100}, "model": {"lora": {"rank": 8}},
    })  # fmt: skip
    cpu = plan_memory(cfg, hand_shape(), hand_work(), device("cpu-24g")).phases[2]
    gpu = plan_memory(cfg, hand_shape(), hand_work(), device("cuda-24g")).phases[2]
    # one group per micro-batch: 70 tokens through 2 layers (see the test above)
    activations = 70 * 2 * (6 * 100 + 200 + 4 * 300 + 7 * 8) * 4
    temporaries = 2 * 70 * (100 + 300) * 4
    assert cpu.components["activations"] == activations
    refill = 10_000 * 4 + 2 * 10_000 * 4  # LoRA gradients + AdamW's two float32 states
    assert cpu.components["freed blocks kept"] == activations + temporaries - refill
    assert "freed blocks kept" not in gpu.components
    full = config_from_dict({**cfg.model_dump(), "model": {"lora": {"enabled": False}}})
    full_cpu = plan_memory(full, hand_shape(), hand_work(), device("cpu-24g")).phases[2]
    assert full_cpu.components["freed blocks kept"] == 0.0  # the 1M parameters' state refills
    # float32 on both (dtype auto is bfloat16 on a GPU): compare at equal dtype
    gpu32 = plan_memory(config_from_dict({**cfg.model_dump(), "model": {
        **cfg.model.model_dump(), "dtype": "float32"}}), hand_shape(), hand_work(),
        device("cuda-24g")).phases[2]  # fmt: skip
    assert cpu.total - gpu32.total == activations + temporaries - refill


def test_largest_finds_the_boundary():
    assert largest(lambda n: n <= 37, 1, 100) == 37
    assert largest(lambda n: n <= 500, 1, 100) == 100
    assert largest(lambda n: False, 1, 100) is None


def test_meta_counts_match_the_real_tiny_model():
    """The meta-device count equals the loaded model's, adapters included (PEFT)."""
    from peft import LoraConfig, get_peft_model

    cfg = config_from_dict({"model": {"name": "tiny-random"}})
    shape = model_shape(cfg)
    real = load_causal_lm("tiny-random", torch.float32)
    assert shape.params == sum(p.numel() for p in real.parameters())
    lora = get_peft_model(real, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                           task_type="CAUSAL_LM"))  # fmt: skip
    assert shape.lora_params == sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert shape.kv_per_token == 2 * 2 * 2 * 16  # layers × (k, v) × kv heads × head dim
    assert shape.cascade
    plain = load_causal_lm("tiny-random", torch.float32)  # `real` now carries adapters
    linears = [m for m in plain.modules() if type(m) is torch.nn.Linear]
    assert shape.linear_params == sum(m.weight.numel() for m in linears)


def test_sampling_holds_packed_weights_where_the_engine_packs():
    """The CPU engine samples through a oneDNN-packed copy of the linear weights
    (forward/fast_linear.py) when they are large enough to pay: each sampling phase holds
    it, in the sampler's dtype; the update does not, nor a GPU, nor packed_linear=false."""
    from dataclasses import replace

    big = replace(hand_shape(), linear_params=40_000_000)  # 160 MB in float32
    cfg = config_from_dict({})
    plan = plan_memory(cfg, big, hand_work(), device("cpu-24g"))
    for phase in plan.phases:
        packed = phase.components.get("packed weights")
        assert packed == (None if phase.name == "update" else 40_000_000 * 4), phase.name
    bf16 = config_from_dict({"rollout": {"sampler_dtype": "bfloat16"}})
    rollout = plan_memory(bf16, big, hand_work(), device("cpu-24g")).phases[1]
    assert rollout.components["packed weights"] == 40_000_000 * 2
    off = config_from_dict({"model": {"packed_linear": False}})
    for cfg_, shape, where in [(off, big, "cpu-24g"), (cfg, big, "h200"),
                               (cfg, hand_shape(), "cpu-24g")]:  # fmt: skip
        plan = plan_memory(cfg_, shape, hand_work(), device(where))
        assert all("packed weights" not in p.components for p in plan.phases)


@pytest.mark.parametrize("router", [False, True], ids=["router-frozen", "router-trained"])
def test_moe_lora_count_is_the_runs(tmp_path, router):
    """On an MoE model the plan counts the adapters the run trains: attention and the
    fused expert weights, the router only with model.lora.train_router."""
    from looprl.loop.policy import add_lora
    from looprl.model.tiny import save_tiny

    folder = save_tiny("qwen3_moe", tmp_path / "moe")
    cfg = config_from_dict({"model": {"name": str(folder), "lora": {"train_router": router}}})
    shape = model_shape(cfg)
    real = add_lora(load_causal_lm(str(folder), torch.float32), cfg.model.lora)
    trained = {n: p.numel() for n, p in real.named_parameters() if p.requires_grad}
    assert any("experts" in n for n in trained)
    assert any("gate" in n and "proj" not in n for n in trained) == router
    assert shape.lora_params == sum(trained.values())


def test_an_mla_model_caches_its_latent_and_plans_no_cascade(tmp_path):
    """DeepSeek V3's MLA caches the compressed latent and the rotary key per layer (kv_lora_rank +
    rope dims), not per-head keys and values; the engine runs it without cascade attention."""
    from looprl.model.tiny import save_tiny

    folder = save_tiny("deepseek_v3", tmp_path / "mla")
    shape = model_shape(config_from_dict({"model": {"name": str(folder)}}))
    assert shape.kv_per_token == 4 * (16 + 8)  # four layers of latent 16 + rotary key 8
    assert not shape.cascade


def test_ling_class_config_counts_7_9b_total_and_1_3b_active():
    cfg = config_from_dict({"model": {"name": str(LING)}})
    shape = model_shape(cfg)
    assert 7.8e9 <= shape.params <= 8.1e9
    assert 1.2e9 <= shape.active_params <= 1.4e9
    assert shape.expert_params > 0.8 * shape.params
    assert not shape.cascade  # linear-attention layers: transformers' own cache


def test_plan_command_on_tiny_random():
    runner = CliRunner(env={"COLUMNS": "250", "NO_COLOR": "1"})
    res = runner.invoke(app, ["plan", "--set", "model.name=tiny-random", "--json"])
    assert res.exit_code == 0, res.output
    result = json.loads(res.output)
    assert result["fits"] and result["device"]["name"] == "cpu-24g"
    assert result["peak_phase"] in ("eval", "rollout", "update", "greedy eval")
    assert 0.5e9 < result["peak_bytes"] < 5e9
    batch = result["largest"]["rollout.batch_size"]
    assert batch["value"] == batch["search_max"] == 256  # every eval episode at once
    small = runner.invoke(app, ["plan", "--set", "model.name=tiny-random", "--set",
                                "rollout.batch_size=256", "--device", "cpu-1g"])  # fmt: skip
    assert small.exit_code == 0, small.output
    assert "does not fit" in small.output and "--set" in small.output
    bad = runner.invoke(app, ["plan", "--set", "model.name=tiny-random", "--device", "tpu"])
    assert bad.exit_code == 2 and "cpu-<N>g" in bad.output


@pytest.mark.parametrize("name", ["dgx-spark", "h200", "a100-80g", "rtx-4090", "cpu-24g"])
def test_named_devices(name):
    assert device(name).usable < device(name).memory


def test_the_embedded_models_known_config_is_what_its_gguf_says():
    """`smollm2-135m`'s config is written out so the planner needs no 6 s GGUF read; it
    must stay the GGUF's own."""
    from looprl.model.load import SMOLLM2_CONFIG, load_model_config, smollm2_gguf_path

    from_gguf = load_model_config(f"gguf:{smollm2_gguf_path()}")
    assert {key: getattr(from_gguf, key) for key in SMOLLM2_CONFIG} == SMOLLM2_CONFIG


def test_a_snapshot_opponent_costs_two_copies_of_the_model():
    cfg = config_from_dict({
        "env": {"name": "tictactoe-game", "args": {"opponent": "mix:minimax=0.5,snapshot=0.5"}},
        "model": {"lora": {"rank": 8}},
    })  # fmt: skip
    every = plan_memory(cfg, hand_shape(), hand_work(), device("cpu-24g")).persistent.components
    assert every["snapshot opponent"] == 2 * (1_000_000 * 4 + 10_000 * 4)
