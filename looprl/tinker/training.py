"""One training client's model on the Tinker server: a base model with PEFT LoRA adapters
(`loop/policy.py`'s `add_lora`), its AdamW (`loop/optim.py`), and the three things a
client asks of it: `forward_backward` (the trainer's exact logprobs of each datum's target
tokens, one of `algo/tinker_losses.py`'s losses, gradients accumulated until the next
step), `optim_step`, and its state saved and loaded."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from looprl.algo import tinker_losses, token_logprobs
from looprl.config import LoraConfig
from looprl.errors import RequestError
from looprl.loop.optim import make_optimizer
from looprl.loop.policy import add_lora
from looprl.tinker.wire import Datum, ForwardBackward

# the tokens one forward pass holds (rows × longest row), each micro-batch's gradients taken
# before the next one runs: its logits (rows × length × vocabulary floats, 200 MB for
# SmolLM2 in float32) and activations are what the server's memory peaks with
TOKEN_BUDGET = 1024
# the ratio thresholds when a request sets none: PPO's documented ε = 0.2
CLIP_LOW, CLIP_HIGH = 0.8, 1.2
POLICY_INPUTS = ("target_tokens", "logprobs", "advantages")
LOSS_INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": POLICY_INPUTS,
    "ppo": POLICY_INPUTS,
    "cispo": POLICY_INPUTS,
    "dro": POLICY_INPUTS,
    "gspo": (*POLICY_INPUTS, "sequence_ratio_mask"),
}
REFUSED_LOSSES = {
    "stable_reinforce": "its objective is not published, so this server cannot compute it",
    "custom": "the SDK runs custom losses client-side (forward_backward_custom) as a "
    "cross_entropy with signed weights; call that instead",
}


@dataclass
class LoraShape:
    """What a client's `lora_config` asks for."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def lora_target_names(model: Any, shape: LoraShape) -> list[str]:
    """The leaf names of the linear layers `shape` adapts: those inside attention blocks
    (`train_attn`), the other ones of the transformer (`train_mlp`), the output head
    (`train_unembed`)."""
    head = model.get_output_embeddings()
    names: set[str] = set()
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        leaf = path.rsplit(".", 1)[-1]
        if module is head:
            if shape.train_unembed:
                names.add(leaf)
        elif "attn" in path or "attention" in path:
            if shape.train_attn:
                names.add(leaf)
        elif shape.train_mlp:
            names.add(leaf)
    if not names:
        raise RequestError(
            "lora_config adapts no layer: set at least one of train_attn, train_mlp, train_unembed"
        )
    return sorted(names)


@dataclass
class TrainedModel:
    """A training client's LoRA model, its optimizer and its gradient-accumulation state."""

    model_id: str
    base_model: str
    lora: LoraShape
    model: Any
    pad_id: int
    optimizer: torch.optim.Optimizer = field(init=False)

    def __post_init__(self) -> None:
        self.model.eval()  # no dropout anywhere: the trainer's logprobs are the sampler's
        self.optimizer = make_optimizer(self.trainable(), "adamw", lr=1e-4, weight_decay=0.0)

    @classmethod
    def create(cls, model_id: str, base_model: str, base: Any, lora: LoraShape, pad_id: int):
        if lora.rank < 1:
            raise RequestError(f"lora_config.rank={lora.rank}: the rank must be 1 or more")
        if lora.seed is not None:
            torch.manual_seed(lora.seed)
        settings = LoraConfig(rank=lora.rank, target_modules=lora_target_names(base, lora))
        with warnings.catch_warnings():  # an adapted head over tied embeddings: intended
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            model = add_lora(base, settings)
        return cls(model_id, base_model, lora, model, pad_id)

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The adapter weights, copied: a snapshot later steps do not change."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    # ---- forward_backward ---------------------------------------------------------------

    def forward_backward(self, request: ForwardBackward) -> tuple[list[np.ndarray], dict]:
        """Each datum's target logprobs and, unless `forward_only`, the loss's gradients
        added to those already accumulated. The loss is the sum over datums."""
        compute = loss_function(request.loss_fn, request.config)
        vocab = self.model.get_output_embeddings().weight.shape[0]
        for i, datum in enumerate(request.data):
            check_datum(datum, LOSS_INPUTS[request.loss_fn], i)
            ids = np.concatenate([datum.tokens, datum.inputs["target_tokens"]])
            if ids.min() < 0 or ids.max() >= vocab:
                raise RequestError(
                    f"data[{i}]: token id {int(ids.max() if ids.max() >= vocab else ids.min())} "
                    f"is outside this model's vocabulary [0, {vocab})"
                )
            if request.loss_fn == "gspo" and not datum.inputs["sequence_ratio_mask"].any():
                raise RequestError(f"data[{i}]: loss_fn='gspo': sequence_ratio_mask marks no token")
        device = next(self.model.parameters()).device
        outputs: list[np.ndarray] = [np.zeros(0, np.float32)] * len(request.data)
        total = 0.0
        for chunk in token_chunks([len(d.tokens) for d in request.data], TOKEN_BUDGET):
            with torch.set_grad_enabled(not request.forward_only):
                logps = self.datum_logprobs([request.data[i] for i in chunk], device)
                loss = sum(
                    compute(logp_T, request.data[i].inputs, device)
                    for i, logp_T in zip(chunk, logps, strict=True)
                )
                if isinstance(loss, torch.Tensor) and loss.requires_grad:
                    loss.backward()
            total += float(loss.detach()) if isinstance(loss, torch.Tensor) else 0.0
            for i, logp_T in zip(chunk, logps, strict=True):
                outputs[i] = logp_T.detach().float().cpu().numpy()
        return outputs, {"loss:sum": total}

    def datum_logprobs(self, data: list[Datum], device: torch.device) -> list[torch.Tensor]:
        """log p(target_t | tokens[:t+1]) of each datum, one forward pass over the rows
        right-padded (causal attention: a real token never sees the padding after it)."""
        length = max(len(d.tokens) for d in data)
        ids_BL = torch.full((len(data), length), self.pad_id, dtype=torch.long)
        targets_BL = torch.zeros((len(data), length), dtype=torch.long)
        for b, datum in enumerate(data):
            ids_BL[b, : len(datum.tokens)] = torch.tensor(datum.tokens)
            targets_BL[b, : len(datum.tokens)] = torch.from_numpy(
                datum.inputs["target_tokens"].astype(np.int64)
            )
        logits_BLV = self.model(input_ids=ids_BL.to(device)).logits
        logp_BL = token_logprobs(logits_BLV.float(), targets_BL.to(device))
        return [logp_BL[b, : len(d.tokens)] for b, d in enumerate(data)]

    # ---- optim_step ---------------------------------------------------------------------

    def optim_step(self, adam: dict[str, Any]) -> dict[str, float]:
        """One AdamW step with the request's parameters on the accumulated gradients, then
        the gradients cleared. grad_clip_norm 0 = no clipping."""
        for group in self.optimizer.param_groups:
            group["lr"] = float(adam.get("learning_rate", 1e-4))
            group["betas"] = (float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95)))
            group["eps"] = float(adam.get("eps", 1e-12))
            group["weight_decay"] = float(adam.get("weight_decay", 0.0))
        clip = float(adam.get("grad_clip_norm", 0.0))
        params = self.trainable()
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm:mean": float(norm)}

    # ---- state --------------------------------------------------------------------------

    def save(self, folder: Path, optimizer: bool) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(self.trainable_state(), folder / "adapter.pt")
        if optimizer:
            torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")

    def load(self, folder: Path, optimizer: bool) -> None:
        state = torch.load(folder / "adapter.pt", map_location="cpu")
        own = dict(self.model.named_parameters())
        if set(state) != {n for n, p in own.items() if p.requires_grad}:
            raise RequestError(
                f"checkpoint {folder.name!r} holds other LoRA layers than this model "
                f"(rank {self.lora.rank}); load it into a client created with its settings"
            )
        with torch.no_grad():
            for name, value in state.items():
                own[name].copy_(value)
        if optimizer:
            if not (folder / "optimizer.pt").exists():
                raise RequestError(f"checkpoint {folder.name!r} holds no optimizer state")
            self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt"))
        self.optimizer.zero_grad(set_to_none=True)


def token_chunks(lengths: list[int], budget: int) -> list[list[int]]:
    """Datum indices in order, cut so that rows × longest row stays within `budget`."""
    chunks: list[list[int]] = []
    current: list[int] = []
    for i, n in enumerate(lengths):
        if current and (len(current) + 1) * max(n, *(lengths[j] for j in current)) > budget:
            chunks.append(current)
            current = []
        current.append(i)
    if current:
        chunks.append(current)
    return chunks


def check_datum(datum: Datum, names: tuple[str, ...], index: int) -> None:
    """Every input the loss reads is there, one value per input token."""
    n = len(datum.tokens)
    if n == 0:
        raise RequestError(f"data[{index}]: model_input holds no tokens")
    for name in names:
        if name not in datum.inputs:
            raise RequestError(
                f"data[{index}]: loss_fn_inputs lacks {name!r} (this loss needs {', '.join(names)})"
            )
        shape = datum.inputs[name].shape
        if tuple(shape) != (n,):
            raise RequestError(
                f"data[{index}]: loss_fn_inputs[{name!r}] has shape {list(shape)}, but "
                f"model_input holds {n} tokens: send one value per input token, shape [{n}]"
            )


def loss_function(name: str, config: dict[str, float]):
    """(logp_T, inputs, device) → the datum's loss, for loss `name` and its config."""
    if name in REFUSED_LOSSES:
        raise RequestError(f"loss_fn={name!r} is refused: {REFUSED_LOSSES[name]}")
    if name not in LOSS_INPUTS:
        raise RequestError(
            f"unknown loss_fn {name!r}: this server computes {', '.join(LOSS_INPUTS)}"
        )
    if name == "dro" and "beta" not in config:
        raise RequestError(
            "loss_fn='dro' needs loss_fn_config={'beta': ...}: the service's default beta "
            "is not published"
        )
    low = config.get("clip_low_threshold", CLIP_LOW)
    high = config.get("clip_high_threshold", CLIP_HIGH)

    def compute(logp_T: torch.Tensor, inputs: dict[str, np.ndarray], device: torch.device):
        def value(key: str) -> torch.Tensor:
            return torch.from_numpy(inputs[key].astype(np.float32)).to(device)

        if name == "cross_entropy":
            return tinker_losses.cross_entropy(logp_T, value("weights"))
        q_T, adv_T = value("logprobs"), value("advantages")
        if name == "importance_sampling":
            return tinker_losses.importance_sampling(logp_T, q_T, adv_T)
        if name == "ppo":
            return tinker_losses.ppo(logp_T, q_T, adv_T, low, high)
        if name == "cispo":
            return tinker_losses.cispo(logp_T, q_T, adv_T, low, high)
        if name == "dro":
            return tinker_losses.dro(logp_T, q_T, adv_T, config["beta"])
        mask_T = value("sequence_ratio_mask")
        return tinker_losses.gspo(logp_T, q_T, adv_T, mask_T, low, high)

    return compute
