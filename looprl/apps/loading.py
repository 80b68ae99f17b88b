"""`load_chat_model(spec)`: a model (alias, hub id, local folder, `gguf:PATH`) or a run
folder loaded as a `ChatModel`. A run is served as its "trained" variant (the base model
plus the run's newest checkpoint, or the one asked for) and its "baseline"; a run without
a checkpoint, like a plain model, as the one variant "base"."""

from __future__ import annotations

from pathlib import Path

from looprl.apps.inference import ChatModel
from looprl.config import config_from_dict, load_config
from looprl.errors import ConfigError
from looprl.loop.checkpoint import has_weights, list_checkpoints, load_weights
from looprl.loop.policy import load_policy


def load_chat_model(spec: str, checkpoint: Path | None = None, device: str = "auto") -> ChatModel:
    """spec: a model (alias like `smollm2-135m` / `tiny-random`, hub id, local path) or a
    run folder (has config.yaml): its base model + its newest checkpoint (or `checkpoint`:
    a checkpoint folder, or a name under RUN/checkpoints). A run without any checkpoint
    is served as its base model (variant "base")."""
    path = Path(spec).expanduser()
    if (path / "config.yaml").is_file():
        return _load_run(path, checkpoint, device)
    if checkpoint is not None:
        raise ConfigError(
            f"--checkpoint needs a run folder, and {spec} is not one (no config.yaml); "
            "pass the run folder as the model"
        )
    cfg = config_from_dict({"model": {"name": spec, "device": device, "lora": {"enabled": False}}})
    policy = load_policy(cfg)
    policy.model.eval()
    if path.is_dir():
        name = path.resolve().name
    elif spec.startswith("gguf:"):
        name = Path(spec[5:]).stem
    else:
        name = spec
    return ChatModel(name, policy, cfg, ("base",))


def _load_run(run: Path, checkpoint: Path | None, device: str) -> ChatModel:
    cfg = load_config(
        run / "config.yaml", [f"model.device={device}", "model.gradient_checkpointing=false"]
    )
    chosen = _pick_checkpoint(run, checkpoint)
    policy = load_policy(cfg)
    policy.model.eval()
    name = run.resolve().name
    if chosen is None:
        return ChatModel(name, policy, cfg, ("base",))
    try:
        load_weights(policy.model, chosen)
    except ValueError as err:
        raise ConfigError(f"{err}; was it written by another run?") from None
    return ChatModel(name, policy, cfg, ("trained", "baseline"), checkpoint=chosen)


def _pick_checkpoint(run: Path, checkpoint: Path | None) -> Path | None:
    if checkpoint is None:
        found = list_checkpoints(run)
        return found[-1] if found else None
    if not checkpoint.exists() and (run / "checkpoints" / checkpoint).exists():
        checkpoint = run / "checkpoints" / checkpoint
    if not has_weights(checkpoint):
        names = ", ".join(p.name for p in list_checkpoints(run)) or "none"
        raise ConfigError(
            f"{checkpoint} is not a looprl checkpoint folder; the checkpoints of {run}: {names}"
        )
    return checkpoint
