"""model.gradient_checkpointing: each decoder layer recomputed in the backward pass
(looprl/model/memory.py `checkpoint_layers`) gives the trainer's logprobs and gradients
bit for bit, keeps its shared-prompt forward (cascade attention, packing), recomputes
only under autograd, and saves a fraction of the activations."""

from __future__ import annotations

import copy

import pytest
import torch

from looprl.forward import cascade
from looprl.forward.score import decoder_and_head, sequence_logprobs
from looprl.model.load import base_model, load_causal_lm
from looprl.model.memory import checkpoint_layers

HEAD = list(range(200, 240))  # a common head over the shared-prefix threshold (16)


def episodes() -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts after one head, each played twice, replies of different lengths (the
    trainer packs them): the shapes of a training batch."""
    sequences, masks = [], []
    for p, tail in enumerate([[300, 301, 302], [310, 311], [320, 321, 322, 323]]):
        for g in range(2):
            reply = [400 + p * 10 + k for k in range(3 + 2 * g + p)]
            sequences.append(HEAD + tail + reply)
            masks.append([0] * (len(HEAD) + len(tail)) + [1] * len(reply))
    return sequences, masks


def tiny(lora: bool, seed: int = 0):
    torch.manual_seed(seed)
    model = load_causal_lm("tiny-random", torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        for name, param in model.named_parameters():
            if "lora_B" in name:  # non-zero: a gradient path through every adapter
                torch.nn.init.normal_(param, std=0.05)
    assert cascade.enable(model)
    return model.train()


def scored(model) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The trainer's logprobs and the gradients of a loss over them, as the update takes
    them (forward/score.py's shared-prompt path)."""
    sequences, masks = episodes()
    model.zero_grad(set_to_none=True)
    logp_BS, mask_BS = sequence_logprobs(model, sequences, masks, 0, torch.device("cpu"), 1.0)
    loss = -(logp_BS * mask_BS).sum() / mask_BS.sum() + (logp_BS * mask_BS).exp().sum() * 1e-2
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    return logp_BS[mask_BS].detach(), grads


def attention_calls(model) -> list[int]:
    """A counter of the attention modules' calls (a recomputation calls them again)."""
    calls = [0]

    def count(*_):
        calls[0] += 1

    for module in base_model(model).modules():
        if type(module).__name__.endswith("Attention"):
            module.register_forward_pre_hook(count)
    return calls


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_checkpointed_layers_give_the_same_logprobs_and_gradients_bit_for_bit(lora):
    plain = tiny(lora)
    checkpointed = copy.deepcopy(plain)
    layers = len(base_model(plain).model.layers)
    assert checkpoint_layers(checkpointed) == layers
    assert checkpoint_layers(checkpointed) == 0  # wrapped once
    for model in (plain, checkpointed):
        decoder_and_head(model)  # its one-off check runs the model: before the count
    calls, plain_calls = attention_calls(checkpointed), attention_calls(plain)
    want, got = scored(plain), scored(checkpointed)
    # the head pass, the tails' pass and the replies' pass, each recomputed once
    assert plain_calls[0] == 3 * layers
    assert calls[0] == 2 * 3 * layers
    assert torch.equal(got[0], want[0])
    assert len(got[1]) == len(want[1]) > 0
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b)


def test_two_backward_passes_in_a_row_stay_exact():
    """The cache is put back after each recomputation: a second micro-batch (and a
    second step after an optimizer update) is as exact as the first."""
    plain, checkpointed = tiny(True, seed=3), tiny(True, seed=3)
    checkpoint_layers(checkpointed)
    results = {}
    for name, model in (("plain", plain), ("checkpointed", checkpointed)):
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        first = scored(model)
        opt.step()
        results[name] = (first, scored(model))
    for got, want in zip(results["checkpointed"], results["plain"]):
        assert torch.equal(got[0], want[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def test_without_autograd_or_in_eval_mode_layers_run_once():
    model = tiny(True)
    checkpoint_layers(model)
    decoder_and_head(model)
    calls = attention_calls(model)
    sequences, masks = episodes()
    with torch.no_grad():
        sequence_logprobs(model, sequences, masks, 0, torch.device("cpu"), 1.0)
    model.eval()
    logp_BS, _ = sequence_logprobs(model, sequences, masks, 0, torch.device("cpu"), 1.0)
    logp_BS.sum().backward()  # in eval mode nothing is recomputed, gradients or not
    assert calls[0] == 2 * 3 * len(base_model(model).model.layers)


def test_the_layers_keep_only_their_inputs_for_the_backward_pass():
    """Bytes autograd keeps for the backward pass from inside the decoder layers (the
    weights aside): everything their norms, projections, attention and MLP save without
    checkpointing; with it, each layer's input and nothing more."""

    def saved_in_layers(model) -> tuple[int, int]:
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages: dict[int, int] = {}
        inputs = [0]
        inside = [False]

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if inside[0] and storage.data_ptr() not in weights:  # weights are kept anyway
                storages[storage.data_ptr()] = storage.nbytes()
            return t

        def enter(_module, args) -> None:
            inside[0] = True
            if torch.is_grad_enabled():  # not decoder_and_head's one-off no-grad check
                inputs[0] += args[0].nbytes

        for layer in base_model(model).model.layers:
            layer.register_forward_pre_hook(enter)
            layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
        sequences, masks = episodes()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp_BS, mask_BS = sequence_logprobs(
                model, sequences, masks, 0, torch.device("cpu"), 1.0
            )
        (logp_BS * mask_BS).sum().backward()
        return sum(storages.values()), inputs[0]

    plain = tiny(True)
    checkpointed = copy.deepcopy(plain)
    checkpoint_layers(checkpointed)
    saved, inputs = saved_in_layers(checkpointed)
    assert saved == inputs > 0
    saved_plain, inputs_plain = saved_in_layers(plain)
    assert inputs_plain == inputs
    assert saved_plain > 10 * inputs  # about twenty activations a layer, some MLP-wide


def test_a_copy_recomputes_its_own_layers():
    """A deepcopy (the `snapshot` opponent's) gets layers whose wrapped forward is bound
    to the copy, not to the original."""
    model = tiny(True)
    checkpoint_layers(model)
    twin = copy.deepcopy(model)
    for a, b in zip(base_model(model).model.layers, base_model(twin).model.layers):
        assert a.forward.__self__ is a and b.forward.__self__ is b
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(0.01)
    assert not torch.equal(scored(twin)[0], scored(model)[0])


def test_the_policy_option_wraps_the_layers_and_keeps_the_cache(tmp_path):
    from looprl.config import load_config
    from looprl.forward.score import _cache_dropped
    from looprl.loop.policy import load_policy
    from looprl.model.memory import CHECKPOINTED

    cfg = load_config(None, ["model.name=tiny-random", "model.gradient_checkpointing=true"])
    policy = load_policy(cfg)
    layers = base_model(policy.model).model.layers
    assert all(getattr(layer, CHECKPOINTED, False) for layer in layers)
    policy.model.train()
    assert not _cache_dropped(policy.model)
