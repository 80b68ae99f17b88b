"""Weight-first linear layers (W @ x^T for decoding's few rows) give F.linear's results,
leave autograd and large inputs to F.linear, and the engine samples the same tokens
with them as the plain full-forward path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_engine import reference_generate

from looprl.engine import GenerationRequest, SamplingParams
from looprl.engine.hf import HFEngine
from looprl.envs.tictactoe import TicTacToeMove
from looprl.forward import weight_first
from looprl.model.load import load_causal_lm


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(3, 24), (2, 5, 24), (1, 1, 24)])
def test_forward_equals_f_linear(bias, shape):
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape)
    want = F.linear(x, layer.weight, layer.bias)
    assert weight_first.enable(layer, force=True)
    with torch.no_grad():
        got = layer(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the result is W @ x^T read back transposed, not F.linear's own output
    assert got.stride() != want.stride() or shape[-2] == 1


def test_autograd_and_large_inputs_keep_f_linear():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    weight_first.enable(layer, force=True)
    x = torch.randn(4, 16, requires_grad=True)
    out = layer(x)
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
    out.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    big = torch.randn(weight_first.MAX_ROWS + 1, 16)
    with torch.no_grad():
        assert torch.equal(layer(big), F.linear(big, layer.weight, layer.bias))


def test_enable_switches_plain_linears_both_ways_and_measures_by_default():
    class Quantized(torch.nn.Linear):  # a subclass with its own forward: left alone
        pass

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Quantized(8, 8), torch.nn.Linear(8, 2))
    keys = list(model.state_dict())
    assert weight_first.enable(model, force=True) and weight_first.enabled(model)
    assert [type(m).__name__ for m in model] == ["WeightFirstLinear", "Quantized"] + [
        "WeightFirstLinear"
    ]
    assert list(model.state_dict()) == keys
    assert not weight_first.enable(model, force=False)
    assert [type(m) for m in model] == [torch.nn.Linear, Quantized, torch.nn.Linear]
    # without force it is measured, and a model this small is never switched
    assert not weight_first.enable(model) and not weight_first.enabled(model)


def test_engine_samples_the_plain_paths_tokens(tokenizer, renderer):
    model = load_causal_lm("tiny-random", torch.float32).eval()
    env = TicTacToeMove(tool_choice="auto")
    requests = []
    for n, task in enumerate(env.tasks("train", n=3, seed=5)):
        obs = env.reset(task)
        prompt = renderer.prompt_ids(obs.messages, obs.tools)
        requests += [GenerationRequest(prompt, max_new_tokens=8 + 5 * n) for _ in range(2)]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=9)
    engine = HFEngine(model, tokenizer, renderer.eos_ids, batch_size=4)
    plain = engine.generate(requests, params)
    assert weight_first.enable(model, force=True)
    fast = engine.generate(requests, params)
    for index, (request, a, b) in enumerate(zip(requests, plain, fast)):
        assert b.ids == a.ids == reference_generate(engine, request, params, index)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
