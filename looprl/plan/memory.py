"""A run's memory by component and phase, from its config, its model's shape and its
workload: the arithmetic of `looprl plan`.

Three phases reach a peak: the held-out eval and the training rollouts (the engine's
KV cache and its logits) and the update (gradients and saved activations of one
micro-batch). The weights, the framework, the adapters and, from the first optimizer
step on, the optimizer state are there in every phase; the peak is the largest phase.
Each figure names the code it follows; `bench/checks/plan_accuracy.py` checks the sum against
the peak resident set of real runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import torch

from looprl.algo.logprobs import head_logprobs
from looprl.config import Config
from looprl.engine.forward_step import FORCED_LOGIT_ROWS
from looprl.forward.fast_linear import MIN_WEIGHT_BYTES, PACKED_DTYPES
from looprl.forward.score import micro_batches
from looprl.loop.batches import scoring_keys
from looprl.loop.optim import EIGHT_BIT_BLOCK
from looprl.plan.devices import Device
from looprl.plan.shape import ModelShape
from looprl.plan.workload import Workload

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# What a looprl process holds before its model: Python, torch, transformers, the
# tokenizer, xgrammar's vocabulary tables; and peft's import with LoRA. Measured on the
# CPU with `bench/checks/plan_accuracy.py --baseline` (framework_cpu_gb, lora_library_gb).
FRAMEWORK_CPU = 0.59e9
LORA_LIBRARY = 0.058e9
# Not measured here (no GPU at hand): a CUDA context with cuBLAS's workspaces on the
# device, and on a unified box also the host side of torch's CUDA libraries.
CUDA_CONTEXT = 1.0e9
CUDA_HOST_LIBRARIES = 2.0e9
# float32 [rows, vocab] tensors alive at once while the engine samples: the logits, a
# contiguous copy, log_softmax, softmax and the constrained candidates (engine/hf.py
# `_sample`); and while it jumps forward k tokens: one chunk of rows' [rows, k - 1,
# vocab] logits (about FORCED_LOGIT_ROWS positions), their scaled copy and its
# log_softmax (`engine/forward_step.py` `forced_logprobs`).
SAMPLING_COPIES = 5
JUMP_COPIES = 3
# float32 [chunk, vocab] tensors of one chunk of `head_logprobs` in backward: the
# recomputed logits, their softmax and the logits' gradient (plus the kept forward one).
HEAD_COPIES = 4
HEAD_CHUNK = head_logprobs.__defaults__[-1]  # rows of the output projection at a time


@dataclass
class Phase:
    name: str
    components: dict[str, float] = field(default_factory=dict)  # bytes
    notes: dict[str, str] = field(default_factory=dict)

    def add(self, key: str, value: float, note: str = "") -> None:
        self.components[key] = float(value)
        if note:
            self.notes[key] = note

    @property
    def total(self) -> float:
        return sum(self.components.values())


def dtype_name(cfg: Config, device: Device) -> str:
    """model.dtype=auto: float32 on the CPU, bfloat16 on a GPU (as `pick_dtype`)."""
    if cfg.model.dtype != "auto":
        return cfg.model.dtype
    return "bfloat16" if device.kind == "cuda" else "float32"


def sampler_dtype_name(cfg: Config, device: Device) -> str:
    """The dtype the engine samples in: the model's, or `rollout.sampler_dtype`'s copy."""
    if cfg.rollout.sampler_dtype == "model":
        return dtype_name(cfg, device)
    return cfg.rollout.sampler_dtype


def optimizer_bytes(cfg: Config, shape: ModelShape, dtype_bytes: int) -> float:
    """AdamW: two states per trainable parameter in its dtype (m and v). 8-bit AdamW: one
    byte each plus a float32 scale per block of 256, for tensors of 4,096 values or more;
    smaller tensors keep two float32 states (loop/optim.py)."""
    lora = cfg.model.lora.enabled
    trainable = shape.lora_params if lora else shape.params
    if cfg.train.optimizer == "adamw":
        return 2.0 * trainable * (4 if lora else dtype_bytes)
    small = shape.lora_small_params if lora else shape.small_params
    return (trainable - small) * (2 + 2 * 4 / EIGHT_BIT_BLOCK) + small * 2 * 4


def persistent(cfg: Config, shape: ModelShape, device: Device) -> Phase:
    """What every phase holds: framework, weights, adapters, optimizer state."""
    dtype = dtype_name(cfg, device)
    b = DTYPE_BYTES[dtype]
    phase = Phase("persistent")
    host = FRAMEWORK_CPU + (LORA_LIBRARY if cfg.model.lora.enabled else 0.0)
    if device.kind == "cpu":
        phase.add("framework", host, "Python, torch, transformers, tokenizer (measured)")
    else:
        host = host + CUDA_HOST_LIBRARIES if device.unified else 0.0
        phase.add("framework", host + CUDA_CONTEXT, "CUDA context and libraries (assumed)")
    routed = f", {shape.expert_params / 1e9:.2f}B in routed experts" if shape.expert_params else ""
    phase.add("weights", shape.params * b, f"{shape.params / 1e6:,.1f}M params in {dtype}{routed}")
    sampler = sampler_dtype_name(cfg, device)
    if sampler != dtype:
        copy = shape.params * DTYPE_BYTES[sampler]
        phase.add("sampler copy", copy, f"rollout.sampler_dtype={sampler}")
    if cfg.model.lora.enabled:
        phase.add(
            "LoRA adapters",
            shape.lora_params * 4,
            f"{shape.lora_params / 1e6:,.2f}M float32, r={cfg.model.lora.rank}",
        )
    phase.add("optimizer state", optimizer_bytes(cfg, shape, b), cfg.train.optimizer)
    if plays_snapshot(cfg):
        copy = shape.params * b + (shape.lora_params * 4 if cfg.model.lora.enabled else 0.0)
        phase.add("snapshot opponent", 2 * copy, "two frozen copies of the model (train, eval)")
    return phase


def plays_snapshot(cfg: Config) -> bool:
    """Whether the run's env has the policy play against its own snapshot (loop/snapshot.py
    keeps two copies of the model for it). An env that cannot be built says so elsewhere."""
    from looprl.envs import capabilities, make_env

    try:
        env = make_env(cfg.env.name, cfg.env.args)
    except Exception:
        return False
    return capabilities(env).snapshot_opponent


def rollout_phase(
    cfg: Config,
    shape: ModelShape,
    work: Workload,
    device: Device,
    episodes: int,
    per_prompt: int,
    name: str,
) -> Phase:
    """The engine decoding `episodes` sequences `rollout.batch_size` at a time
    (engine/hf.py): per row a KV buffer of its own columns plus room for every new
    token; the shared head once per batch with cascade attention; the logits of the last
    position; and the prefill of the batch's distinct prompts."""
    b = DTYPE_BYTES[dtype_name(cfg, device)]
    rows = min(cfg.rollout.batch_size, episodes)
    head = work.head_tokens if shape.cascade else 0
    columns = work.prompt_tokens - head + work.response_tokens
    phase = Phase(name)
    kv = rows * columns * shape.kv_per_token * b + head * shape.kv_per_token * b
    kv += rows * shape.state_per_row
    phase.add(
        "KV cache",
        kv,
        f"{rows} rows × {columns} columns" + (f", shared head of {head} once" if head else ""),
    )
    jump_positions = 0
    if work.forced_tokens > 1:
        per_row = work.forced_tokens - 1
        jump_positions = min(rows, max(1, FORCED_LOGIT_ROWS // per_row)) * per_row
    logits = shape.vocab * 4 * (rows * SAMPLING_COPIES + JUMP_COPIES * jump_positions)
    jump = f", forced call of {work.forced_tokens} tokens in one pass" if work.forced_tokens else ""
    phase.add("logits", logits, f"{rows} rows × {shape.vocab:,} float32{jump}")
    prefill = max(1, rows // per_prompt) * (work.prompt_tokens - head)
    width = 4 * shape.hidden + 3 * shape.mlp_width + shape.attention_width
    phase.add("prefill", prefill * width * b, f"{prefill} prompt tokens through one layer")
    sampler = sampler_dtype_name(cfg, device)
    packed = shape.linear_params * DTYPE_BYTES[sampler]
    if (
        device.kind == "cpu"
        and cfg.model.packed_linear
        and getattr(torch, sampler) in PACKED_DTYPES
        and packed >= MIN_WEIGHT_BYTES
    ):
        phase.add(
            "packed weights",
            packed,
            "the linear weights in oneDNN's layout, while "
            "sampling (model.packed_linear, where timed faster)",
        )
    return phase


def _micro_batch(cfg: Config, work: Workload) -> tuple[int, int, int]:
    """(rows, tokens through the model, loss positions) of the largest micro-batch of a
    minibatch, split by the trainer's own `micro_batches` over stand-in episodes of the
    workload's lengths (every episode taken as learning, as at worst)."""
    groups = -(-cfg.rollout.tasks_per_step // cfg.algo.num_minibatches)
    return _split(
        groups,
        cfg.rollout.group_size,
        cfg.train.micro_batch_tokens,
        work.prompt_tokens,
        work.head_tokens,
        work.response_tokens,
    )


@lru_cache(maxsize=256)  # the fit searches plan the same split many times
def _split(groups: int, size: int, budget: int, prompt: int, head: int, response: int) -> tuple:
    episodes = [
        SimpleNamespace(
            token_ids=[g] * prompt + [0] * response,
            loss_mask=[0] * prompt + [1] * response,
            temperature=1.0,
        )
        for g in range(groups)
        for _ in range(size)
    ]
    best = (0, 0, 0)
    for indices in micro_batches(*scoring_keys(episodes), budget):
        chunk = [episodes[i] for i in indices]
        prompts = len({e.token_ids[0] for e in chunk})
        tokens = head + prompts * (prompt - head) + len(chunk) * response
        best = max(best, (tokens, len(chunk), len(chunk) * response))
    tokens, rows, loss = best
    return rows, tokens, loss


def activation_width(cfg: Config, shape: ModelShape) -> float:
    """Values autograd keeps per token and layer (checked against saved-tensor hooks):
    the two norms' inputs and outputs (4 H), query/key/value (their widths), the
    attention output and o_proj's input (2 H), the MLP's gate, activation, up and product
    (4 × its width); each LoRA layer adds its rank; full fine-tuning keeps 2 H more."""
    width = 6 * shape.hidden + shape.attention_width + 4 * shape.mlp_width
    if cfg.model.lora.enabled:
        return width + shape.lora_linears_per_layer * cfg.model.lora.rank
    return width + 2 * shape.hidden


def update_phase(cfg: Config, shape: ModelShape, work: Workload, device: Device) -> Phase:
    """One micro-batch's forward and backward (loop/update.py, forward/score.py): the
    gradients of the trainable parameters, the activations autograd saves, the output
    projection's chunks and the backward pass's own temporaries."""
    b = DTYPE_BYTES[dtype_name(cfg, device)]
    lora = cfg.model.lora.enabled
    trainable = shape.lora_params if lora else shape.params
    phase = Phase("update")
    phase.add("gradients", trainable * (4 if lora else b), f"{trainable / 1e6:,.2f}M")
    rows, tokens, loss = _micro_batch(cfg, work)
    width = activation_width(cfg, shape)
    if cfg.model.gradient_checkpointing:  # prompts still shared, each layer's input kept
        saved = tokens * b * (shape.layers * shape.hidden + width)
        how = "gradient checkpointing: layer inputs + one layer"
    else:
        saved = tokens * shape.layers * width * b
        how = f"{shape.layers} layers"
    if not shape.cascade:  # each episode attends to its own copy of its prompt's KV
        saved += rows * work.prompt_tokens * shape.kv_per_token * b
    phase.add("activations", saved, f"micro-batch of {tokens:,} tokens ({rows} episodes), {how}")
    chunk = min(HEAD_CHUNK, max(loss, 1))
    phase.add(
        "logits",
        chunk * shape.vocab * 4 * HEAD_COPIES,
        f"{chunk} positions × {shape.vocab:,} at a time",
    )
    temporaries = 2 * tokens * (shape.hidden + shape.mlp_width) * b
    phase.add("backward temporaries", temporaries, "one layer's gradients in flight")
    if device.kind == "cpu":
        refill = trainable * (4 if lora else b) + optimizer_bytes(cfg, shape, b)
        phase.add(
            "freed blocks kept",
            heap_retention(saved, temporaries, refill),
            "glibc heap: an earlier micro-batch's freed blocks, less what the "
            "gradients and optimizer state refill",
        )
    return phase


def heap_retention(saved: float, temporaries: float, refill: float) -> float:
    """Memory the CPU allocator holds that no tensor uses, at the update's peak: one
    earlier micro-batch's blocks (its saved activations and backward temporaries), less
    what long-lived tensors allocated later take back (`refill`: the gradients and the
    optimizer state).

    glibc serves a tensor under its mmap threshold (which rises to the size of the
    largest block freed so far, up to 32 MiB: every per-layer activation here) from its
    heaps, and keeps a freed block there until `malloc_trim`, which the loop calls only
    after the rollouts and the update. The old-logprob pass and each micro-batch before
    the last leave freed blocks; the next micro-batch reuses them only where its blocks
    fit the holes, so the resident set grows past the live tensors. Measured with
    `bench/speed/update_memory.py` (SmolLM2-135M, LoRA, 850-token micro-batches): torch's live
    tensor bytes peak at 1.32 GB, what `update_phase` counts without this term; the
    resident set over what stays after the update peaks at 1.60 GB after one micro-batch
    (1.41 GB with glibc's mmap threshold fixed at 128 KiB) and 2.01 GB after seven
    forward passes (a trim before every forward pass left that excess as it was: part of
    it arises within one pass).

    The gradients (allocated during the backward passes) and the optimizer state
    (allocated at the first optimizer step, once the first update's activations are
    freed) are per-parameter tensors that land in those holes. With LoRA they are small
    and the holes stay; with full fine-tuning they are larger than the holes, which are
    then all refilled. This is the model `bench/checks/plan_accuracy.py` checks against the
    peak resident set of two-step runs (SmolLM2-135M LoRA: 0.74 GB of excess measured,
    1.04 GB counted; full fine-tuning with AdamW: 0.17 GB measured, none counted; with
    8-bit AdamW, whose state is a quarter of AdamW's: 0.56 GB measured, 0.40 GB
    counted). A GPU's caching allocator is another matter, not modelled."""
    return max(0.0, saved + temporaries - refill)


@dataclass
class Plan:
    persistent: Phase
    phases: list[Phase]

    def peak(self) -> tuple[str, float]:
        top = max(self.phases, key=lambda p: p.total)
        return top.name, self.persistent.total + top.total


def plan_memory(cfg: Config, shape: ModelShape, work: Workload, device: Device) -> Plan:
    steps = cfg.rollout.tasks_per_step * cfg.rollout.group_size
    evals = cfg.eval.tasks * cfg.eval.samples_per_task
    phases = [
        rollout_phase(cfg, shape, work, device, evals, cfg.eval.samples_per_task, "eval"),
        rollout_phase(cfg, shape, work, device, steps, cfg.rollout.group_size, "rollout"),
        update_phase(cfg, shape, work, device),
    ]
    if cfg.eval.greedy_count:  # one episode a task: every row prefills a prompt of its own
        phases.append(
            rollout_phase(cfg, shape, work, device, cfg.eval.greedy_count, 1, "greedy eval")
        )
    return Plan(persistent(cfg, shape, device), phases)


def summary(plan: Plan) -> dict[str, Any]:
    name, peak = plan.peak()
    return {
        "persistent": plan.persistent.components,
        "phases": {p.name: {"components": p.components, "total": p.total} for p in plan.phases},
        "notes": {
            **plan.persistent.notes,
            **{f"{p.name}/{k}": v for p in plan.phases for k, v in p.notes.items()},
        },
        "peak_phase": name,
        "peak_bytes": peak,
    }
