"""Checkpoints: trainable weights + optimizer + scheduler + RNG states + step.

A checkpoint is written into a temporary folder and renamed into place, so a crash in
the middle of a write leaves the previous checkpoint intact. The newest `keep` are kept.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

PREFIX = "step_"


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    return {
        name: p.detach().contiguous().cpu()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    extra: dict[str, Any],
    keep: int,
) -> Path:
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # left by a writer that was killed mid-write
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"{PREFIX}{step:06d}"
    state = {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
    }
    save_weights(
        final,
        model,
        {"step": step, **extra},
        also=lambda folder: torch.save(state, folder / "state.pt"),
    )
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_weights(
    folder: Path, model: Any, meta: dict[str, Any], also: Callable[[Path], None] | None = None
) -> Path:
    """The model's trainable weights and `meta` (and what `also` writes beside them: a
    checkpoint's optimizer state), written into a temporary folder renamed to `folder`:
    whole or not at all over what `folder` held. Weights alone are not resumable, but
    load wherever a checkpoint does (eval, chat, serve, export)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
    try:
        save_file(trainable_state(model), str(tmp / "trainable.safetensors"))
        if also is not None:
            also(tmp)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders are never listed)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(
        p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / "meta.json").exists()
    )


def load_weights(model: Any, checkpoint: Path) -> dict[str, Any]:
    """Load a checkpoint's trainable weights into `model`; return its metadata."""
    state = load_file(str(checkpoint / "trainable.safetensors"))
    params = dict(model.named_parameters())
    missing = [name for name in state if name not in params]
    if missing:
        raise ValueError(f"checkpoint {checkpoint} does not fit this model: {missing[:3]} ...")
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))
    return json.loads((checkpoint / "meta.json").read_text())


def load_training_state(checkpoint: Path, optimizer: Any, scheduler: Any) -> None:
    state = torch.load(checkpoint / "state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])


def export_model(run_dir: Path, out: Path, checkpoint: Path | None = None) -> Path:
    """Write a plain transformers model folder (LoRA merged into the weights) plus the
    tokenizer, loadable with `AutoModelForCausalLM.from_pretrained(out)`."""
    from looprl.config import load_config
    from looprl.loop.policy import load_policy

    cfg = load_config(run_dir / "config.yaml", ["model.device=cpu"])
    checkpoints = list_checkpoints(run_dir)
    checkpoint = checkpoint or (checkpoints[-1] if checkpoints else None)
    if checkpoint is None:
        raise ValueError(f"{run_dir} has no checkpoint to export")
    policy = load_policy(cfg)
    load_weights(policy.model, checkpoint)
    model = policy.model
    if cfg.model.lora.enabled:
        model = model.merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    policy.tokenizer.save_pretrained(out)
    return out
