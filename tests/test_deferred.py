"""Sampled tokens kept on the device between host copies (engine/deferred.py): the same
completions as a copy at every step, one copy in `FLUSH_EVERY` steps, rows that ended
between two copies trimmed to their end with their KV as a step-by-step decode leaves
it, and rows that need host state at every step keep the step-by-step path."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from looprl.engine import GenerationRequest, SamplingParams, deferred, sampling
from looprl.engine.hf import HFEngine
from looprl.envs.builtin.tictactoe import TicTacToeMove


@pytest.fixture()
def requests(renderer) -> list[GenerationRequest]:
    """Six prompts; the third row is pushed towards EOS (a logit bias, which needs no
    host state), so that it ends between two copies while the others go on."""
    env = TicTacToeMove(tool_choice="auto")
    prompts = [
        renderer.prompt_ids(env.reset(task).messages, env.reset(task).tools)
        for task in env.tasks("train", n=6, seed=2)
    ]
    eos = renderer.eos_ids[0]
    return [
        GenerationRequest(p, keep_kv=True, logit_bias={eos: 30.0} if n == 2 else None)
        for n, p in enumerate(prompts)
    ]


def _generate(model, tokenizer, renderer, requests, flush_every, monkeypatch, copies=None):
    monkeypatch.setattr(deferred, "CPU_FLUSH_EVERY", max(flush_every, 1))
    if copies is not None:
        for module in (deferred, sampling):  # the deferred copies, and `choose`'s per step

            def counted(*tensors, _name=module.__name__, _real=sampling.to_host):
                copies.append(_name)
                return _real(*tensors)

            monkeypatch.setattr(module, "to_host", counted)
    if flush_every == 0:  # the per-step path: a streaming caller needs every token at once
        requests = [replace(r, on_token=lambda *_: None) for r in requests]
    engine = HFEngine(model, tokenizer, renderer.eos_ids, batch_size=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=3)
    with engine.session():
        first = engine.generate(requests, params)
        second = [  # the next turn: extends each row's kept KV (its columns must match)
            GenerationRequest(r.prompt_ids + o.ids + [198, 2683, 359])
            for r, o in zip(requests, first)
        ]
        again = engine.generate(second, params)
    return first + again


def test_deferred_copies_give_the_step_by_step_completions(
    tiny_model, tokenizer, renderer, requests, monkeypatch
):
    """Two turns in a session (the second extends each row's kept KV): the same tokens
    as the per-step path, and about one copy to the host in eight steps."""
    copies: list[str] = []
    stepwise = _generate(tiny_model, tokenizer, renderer, requests, 0, monkeypatch)
    deferred_outs = _generate(tiny_model, tokenizer, renderer, requests, 8, monkeypatch, copies)
    assert [o.ids for o in deferred_outs] == [o.ids for o in stepwise]
    for a, b in zip(deferred_outs, stepwise):
        assert a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    ended_early = stepwise[2]
    assert ended_early.finish_reason == "stop" and len(ended_early.ids) < 8  # between copies
    assert "looprl.engine.sampling" not in copies  # no per-step copy in `choose`
    steps = sum(len(o.ids) for o in stepwise) / 4  # decode steps, about: 4 rows a step
    assert 0 < len(copies) <= steps / 4, (len(copies), steps)


def test_rows_that_need_host_state_keep_the_per_step_path(
    tiny_model, tokenizer, renderer, requests, monkeypatch
):
    """A stop string is looked for in the text at every step: no deferral."""
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3, stop=["zzz"])
    copies: list[str] = []
    monkeypatch.setattr(
        sampling, "to_host", lambda *t, _real=sampling.to_host: copies.append(1) or _real(*t)
    )
    engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids, batch_size=4)
    outs = engine.generate(requests[:2], params)
    assert len(copies) == max(len(o.ids) for o in outs)  # one copy a step
    assert not deferred.deferrable(
        [engine._row(0, requests[0], params, 0)], params, streaming=False
    )
    assert not deferred.deferrable([engine._row(0, requests[0], SamplingParams(), 0)], None, True)


@torch.inference_mode()
def test_pending_tokens_are_sampled_at_their_own_positions(tiny_model, tokenizer, renderer):
    """`ahead` moves a row's draw to the position it will have: a row sampled k steps
    ahead draws what a row holding k more tokens draws, and the draws move with k."""
    engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids)
    params = SamplingParams(temperature=1.0, seed=1)
    logits = torch.zeros(1, tiny_model.config.vocab_size)  # uniform: any token may come
    ahead, held = [], []
    for k in range(8):
        row = engine._row(0, GenerationRequest([1, 2, 3]), params, 1)
        ahead.append(engine._sample(logits, params, [row], k)[0].item())
        row.ids = [7] * k
        held.append(engine._sample(logits, params, [row])[0].item())
    assert ahead == held
    assert len(set(ahead)) > 4
