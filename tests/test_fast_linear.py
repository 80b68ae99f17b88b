"""Sampling's fast linear layers (weight-first W @ x^T, oneDNN-packed weights) give
F.linear's results, leave autograd and other devices to F.linear, hold packed copies only
between pack and unpack (repacking a weight changed in place), and the engine samples
the same tokens with them as the plain full-forward path, dropping its copies when a
generation or session ends."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_engine import reference_generate

from looprl.engine import GenerationRequest, SamplingParams
from looprl.engine.hf import HFEngine
from looprl.envs.builtin.tictactoe import TicTacToeMove
from looprl.forward import fast_linear
from looprl.forward.fast_linear import FastLinear, Forms
from looprl.model.load import load_causal_lm

FORMS = {"weight_first": Forms(weight_first=True), "packed": Forms(packed=True)}


def switch(model, forms: Forms) -> Forms:
    return fast_linear.enable(model, weight_first=forms.weight_first, packed=forms.packed)


def packed_copies(model) -> int:
    return sum(type(m) is FastLinear and m._packed is not None for m in model.modules())


def test_this_machine_has_onednn_packing():
    """The packed form's tests below would say nothing without it (CI's CPU has it)."""
    assert fast_linear.packing_supported([torch.zeros(2, 2)])


@pytest.mark.parametrize("form", ["weight_first", "packed"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(3, 24), (2, 5, 24), (1, 1, 24), (24,)])
def test_forward_equals_f_linear(form, bias, shape):
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape)
    want = F.linear(x, layer.weight, layer.bias)
    assert switch(layer, FORMS[form]) == FORMS[form]
    fast_linear.pack(layer)
    with torch.no_grad():
        got = layer(x)
        strided = layer(torch.randn(24, *shape[:-1]).movedim(0, -1))  # last dim strided
    assert got.shape == want.shape and strided.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if form == "weight_first" and x.dim() > 1:  # W @ x^T read back transposed
        assert got.stride() != want.stride() or shape[-2] == 1
    assert (layer._packed is not None) == (form == "packed")


def test_bfloat16_weights_pack_where_the_cpu_can():
    """oneDNN packs bfloat16 only with AVX-512 (or AVX-NE-CONVERT): elsewhere a layer
    asked to pack stays F.linear, and nothing raises."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 16).to(torch.bfloat16)
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    forms = switch(layer, FORMS["packed"])
    fast_linear.pack(layer)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    can = fast_linear.packs_dtype(torch.bfloat16)
    assert forms.packed == can
    assert (getattr(layer, "_packed", None) is not None) == can
    if can:
        assert layer._packed.dtype == torch.bfloat16


def test_a_dtype_onednn_cannot_pack_is_left_unpacked(monkeypatch):
    """A reorder that raises for a dtype (bfloat16 on an AVX2 CPU) turns the packed form
    off for it, whatever the timing or the caller asks."""

    def reorder(weight, rows):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support")

    monkeypatch.setattr(fast_linear, "_REORDER", reorder)
    fast_linear.packs_dtype.cache_clear()
    try:
        assert not fast_linear.packs_dtype(torch.float32)
        layer = torch.nn.Linear(8, 4)
        assert not fast_linear.packing_supported([layer.weight])
        assert switch(layer, FORMS["packed"]) == Forms()
        fast_linear.pack(layer)
        with torch.no_grad():
            x = torch.randn(3, 8)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    finally:
        fast_linear.packs_dtype.cache_clear()


@pytest.mark.parametrize("form", ["weight_first", "packed"])
def test_autograd_and_large_inputs_keep_f_linear(form):
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    switch(layer, FORMS[form])
    fast_linear.pack(layer)
    x = torch.randn(4, 16, requires_grad=True)
    out = layer(x)
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
    out.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    if form == "weight_first":
        big = torch.randn(fast_linear.MAX_ROWS + 1, 16)
        with torch.no_grad():
            assert torch.equal(layer(big), F.linear(big, layer.weight, layer.bias))


def test_packed_copies_live_between_pack_and_unpack_and_follow_the_weight():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    switch(model, FORMS["packed"])
    assert packed_copies(model) == 0  # switched on, not packed yet: F.linear meanwhile
    fast_linear.pack(model)
    assert packed_copies(model) == 2
    first = model[0]._packed
    fast_linear.pack(model)  # same weights: the same copies
    assert model[0]._packed is first
    x = torch.randn(3, 8)
    with torch.no_grad():
        model[0].weight.mul_(2.0)  # an optimizer step changes a weight in place
        torch.testing.assert_close(model(x), F.linear(F.linear(x, model[0].weight,
            model[0].bias), model[1].weight, model[1].bias))  # fmt: skip
    assert model[0]._packed is not first  # repacked at its call
    model[1].load_state_dict({"weight": torch.zeros(4, 8), "bias": torch.ones(4)})
    with torch.no_grad():
        assert torch.equal(model(x), torch.ones(3, 4))
    twin = copy.deepcopy(model)  # oneDNN's copies have no storage: a copy carries none
    assert packed_copies(twin) == 0 and type(twin[0]) is FastLinear
    with torch.no_grad():
        torch.testing.assert_close(twin(x), model(x))
    fast_linear.unpack(model)
    assert packed_copies(model) == 0
    with torch.no_grad():
        assert torch.equal(model(x), torch.ones(3, 4))


def test_enable_switches_plain_linears_both_ways_and_measures_by_default():
    class Quantized(torch.nn.Linear):  # a subclass with its own forward: left alone
        pass

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Quantized(8, 8), torch.nn.Linear(8, 2))
    keys = list(model.state_dict())
    both = Forms(weight_first=True, packed=True)
    assert switch(model, both) == both and fast_linear.enabled(model) == both
    assert [type(m).__name__ for m in model] == ["FastLinear", "Quantized", "FastLinear"]
    assert list(model.state_dict()) == keys
    fast_linear.pack(model)
    assert switch(model, Forms()) == Forms() and not fast_linear.enabled(model)
    assert [type(m) for m in model] == [torch.nn.Linear, Quantized, torch.nn.Linear]
    assert all(m.__dict__.get("_packed") is None for m in model)  # switching off unpacks
    # without forcing it is measured, and a model this small is never switched
    assert fast_linear.enable(model) == Forms() and not fast_linear.enabled(model)


def engine_requests(renderer):
    env = TicTacToeMove(tool_choice="auto")
    requests = []
    for n, task in enumerate(env.tasks("train", n=3, seed=5)):
        obs = env.reset(task)
        prompt = renderer.prompt_ids(obs.messages, obs.tools)
        requests += [GenerationRequest(prompt, max_new_tokens=8 + 5 * n) for _ in range(2)]
    return requests


@pytest.mark.parametrize("form", ["weight_first", "packed"])
def test_engine_samples_the_plain_paths_tokens(tokenizer, renderer, form):
    model = load_causal_lm("tiny-random", torch.float32).eval()
    requests = engine_requests(renderer)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=9)
    engine = HFEngine(model, tokenizer, renderer.eos_ids, batch_size=4)
    assert not fast_linear.enabled(model)  # too small to pay: timed off
    plain = engine.generate(requests, params)
    switch(model, FORMS[form])
    fast = engine.generate(requests, params)
    assert packed_copies(model) == 0  # dropped when the generation ended
    for index, (request, a, b) in enumerate(zip(requests, plain, fast)):
        assert b.ids == a.ids == reference_generate(engine, request, params, index)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_a_session_keeps_its_packed_copies_until_it_ends(tokenizer, renderer):
    model = load_causal_lm("tiny-random", torch.float32).eval()
    engine = HFEngine(model, tokenizer, renderer.eos_ids, batch_size=4, packed_linear=False)
    assert engine.packed is False and not fast_linear.enabled(model)
    switch(model, FORMS["packed"])
    requests = engine_requests(renderer)[:2]
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=1)
    with engine.session():
        engine.generate(requests, params)
        copies = [m._packed for m in model.modules() if type(m) is FastLinear]
        assert copies and all(c is not None for c in copies)
        engine.generate(requests, params)  # the next turn packs nothing again
        assert [m._packed for m in model.modules() if type(m) is FastLinear] == copies
    assert packed_copies(model) == 0


def lora_stack(seed: int = 0):
    """Two linear layers under PEFT LoRA adapters with non-zero B (a trained adapter)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8, bias=False)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    model = get_peft_model(Stack(), LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model.eval()


def test_a_lora_layer_samples_through_one_merged_packed_product():
    model = lora_stack()
    x = torch.randn(5, 16)
    with torch.no_grad():
        want = model(x)
        with model.disable_adapter():
            base = model(x)
    assert not torch.allclose(want, base, atol=1e-3)  # the adapters matter here
    switch(model, FORMS["packed"])
    fast_linear.pack(model)
    layers = [m for m in model.modules() if isinstance(m, fast_linear.MergedLora)]
    assert len(layers) == 2 and all(m._merged is not None for m in layers)
    assert packed_copies(model) == 0  # no copy of the base or adapter layers besides
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
        with model.disable_adapter():  # PEFT's forward: the base layers alone
            torch.testing.assert_close(model(x), base, rtol=1e-5, atol=1e-5)
    grad_x = x.clone().requires_grad_(True)
    out = model(grad_x)  # autograd: PEFT's forward, gradients reach the adapters
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    lora_b = next(p for n, p in model.named_parameters() if "lora_B" in n)
    assert lora_b.grad is not None and lora_b.grad.abs().sum() > 0
    with torch.no_grad():
        lora_b.add_(1.0)  # an optimizer step in place: merged again at the next call
        model.train()
        changed = model(x)  # training mode: PEFT's forward
        model.eval()
        torch.testing.assert_close(model(x), changed, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(changed, want, atol=1e-3)
    twin = copy.deepcopy(model)  # the copy carries no oneDNN tensor
    with torch.no_grad():
        torch.testing.assert_close(twin(x), changed, rtol=1e-5, atol=1e-5)
    fast_linear.unpack(model)
    assert not any(isinstance(m, fast_linear.MergedLora) for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(x), changed, rtol=1e-5, atol=1e-5)


def test_engine_with_trained_lora_adapters_samples_the_plain_paths_tokens(tokenizer, renderer):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    base = load_causal_lm("tiny-random", torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    requests = engine_requests(renderer)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=4)
    engine = HFEngine(model, tokenizer, renderer.eos_ids, batch_size=4)
    plain = engine.generate(requests, params)
    switch(model, FORMS["packed"])
    merged = []
    original = fast_linear.MergedLora._merge
    try:  # count the merges: one per adapted layer and generation
        fast_linear.MergedLora._merge = lambda self: merged.append(self) or original(self)
        fast = engine.generate(requests, params)
    finally:
        fast_linear.MergedLora._merge = original
    adapted = sum(1 for n, _ in model.named_modules() if n.endswith(".base_layer"))
    assert adapted and len(merged) == adapted
    assert not any(isinstance(m, fast_linear.MergedLora) for m in model.modules())
    for a, b in zip(plain, fast):
        assert b.ids == a.ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


@pytest.mark.parametrize("form", ["weight_first", "packed"])
def test_a_column_major_input_reaches_the_product_row_major(form, monkeypatch):
    """A weight-first layer's output is a transposed view and elementwise ops keep that
    layout, so the next layer can get a column-major input; it is copied row-major first
    (MKL's W @ x^T is much slower on the other layout)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40)
    switch(layer, FORMS[form])
    fast_linear.pack(layer)
    seen = []
    real = fast_linear._row_major
    monkeypatch.setattr(
        fast_linear, "_row_major", lambda x: seen.append(real(x).stride()) or real(x)
    )
    x = torch.randn(24, 6).t()  # [6, 24], column-major
    with torch.no_grad():
        got = layer(x)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert seen == [(24, 1)]


def test_lora_layers_are_timed_with_their_adapters_products(monkeypatch):
    """The start-up timing runs each LoRA layer as sampling would: its base weight with
    the adapter's products in the plain and weight-first forms (the merged copy needs
    none), and never times the adapters' small A and B layers as layers of their own."""
    seen = []

    def timings(layers, packed):
        seen.append(layers)
        return {"plain": 1.5, "weight_first": 1.0, "packed": 0.9}

    monkeypatch.setattr(fast_linear, "_timings", timings)
    monkeypatch.setattr(fast_linear, "MIN_WEIGHT_BYTES", 0)
    model = lora_stack()
    assert fast_linear.enable(model) == Forms(weight_first=True, packed=True)
    bases = {id(m.base_layer): m for m in model.modules() if hasattr(m, "get_delta_weight")}
    (layers,) = seen
    assert len(layers) == 2
    for weight, (lora_a, lora_b, scaling) in layers:
        owner = next(m for m in bases.values() if m.base_layer.weight is weight)
        assert lora_a is owner.lora_A["default"] and lora_b is owner.lora_B["default"]
        assert scaling == 2.0  # alpha 8 / r 4
    plain = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    fast_linear.enable(plain)
    assert [adapter for _, adapter in seen[1]] == [None, None]


def test_the_timing_runs_every_form_with_and_without_adapters():
    model = lora_stack()
    (layer,) = [m for m in model.modules() if hasattr(m, "get_delta_weight")][:1]
    adapter = (layer.lora_A["default"], layer.lora_B["default"], 2.0)
    got = fast_linear._timings(
        [(layer.base_layer.weight, adapter), (torch.randn(8, 32), None)], True, repeats=1
    )
    assert set(got) == {"plain", "weight_first", "packed"} and all(t > 0 for t in got.values())
