"""The hf engine's fast paths keep exactness: prefix sharing and jump-forward decoding
record the policy's own logprobs, and forced calls are always valid."""

from __future__ import annotations

import pytest
import torch

from looprl.engine import GenerationRequest, SamplingParams, ToolConstraint
from looprl.engine.hf import HFEngine
from looprl.envs.tictactoe import TicTacToeMove


def full_forward_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


@pytest.fixture()
def forced_requests(renderer):
    env = TicTacToeMove()
    requests = []
    for task in env.tasks("eval", n=3):
        obs = env.reset(task)
        prompt = renderer.prompt_ids(obs.messages, obs.tools)
        constraint = ToolConstraint(obs.tools, "required", renderer.format)
        requests += [GenerationRequest(prompt, constraint) for _ in range(2)]  # shared prompts
    return env, requests


@pytest.mark.parametrize("jump_forward", [True, False])
def test_forced_calls_are_valid_and_logprobs_exact(
    tiny_model, tokenizer, renderer, forced_requests, jump_forward
):
    env, requests = forced_requests
    engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids, jump_forward=jump_forward)
    outs = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=96, seed=3))
    tools = env.reset(env.tasks("eval", n=1)[0]).tools
    for request, out in zip(requests, outs):
        assert out.finish_reason == "stop"
        result = renderer.parse(renderer.decode(out.ids), tools)
        assert result.failure is None and result.calls[0].name == "choose_square"
        ref = full_forward_logprobs(tiny_model, request.prompt_ids, out.ids)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-4


def test_jump_forward_uses_fewer_passes(tiny_model, tokenizer, renderer, forced_requests):
    _, requests = forced_requests
    counts = {}
    for jump in (True, False):
        engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids, jump_forward=jump)
        calls: list[int] = []
        hook = tiny_model.register_forward_hook(lambda *a, calls=calls: calls.append(1))
        try:
            engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=96, seed=3))
        finally:
            hook.remove()
        counts[jump] = len(calls)
    assert counts[True] * 3 < counts[False], counts


def test_canonical_tokens_under_jump_forward(tiny_model, tokenizer, renderer, forced_requests):
    _, requests = forced_requests
    engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids)
    out = engine.generate(requests[:1], SamplingParams(temperature=0.0, max_new_tokens=96))[0]
    text = renderer.decode(out.ids)
    assert out.ids[:-1] == tokenizer.encode(text, add_special_tokens=False)


def test_forced_grammar_keeps_the_schema_property_order(tokenizer, renderer):
    """A call written in the schema's property order (as demonstrations are) is accepted."""
    from looprl.chat.parsers import format_tool_call
    from looprl.engine.grammar import GrammarCache
    from looprl.types import ToolCall

    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["zeta", "alpha"], "additionalProperties": False,
        "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}}}}}  # fmt: skip
    cache = GrammarCache(tokenizer, len(tokenizer), renderer.eos_ids)
    matcher = cache.matcher(ToolConstraint([tool], "required", "hermes"))
    text = format_tool_call(ToolCall("f", {"zeta": 1, "alpha": 2}), "hermes")
    assert all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))


def test_forced_length_limited_strings_stay_valid_json(tokenizer, renderer):
    """xgrammar lets raw control characters into maxLength strings; the rewritten
    pattern keeps the limit and keeps the JSON valid."""
    from looprl.engine.grammar import GrammarCache

    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["s"], "additionalProperties": False,
        "properties": {"s": {"type": "string", "maxLength": 5}}}}}  # fmt: skip
    cache = GrammarCache(tokenizer, len(tokenizer), renderer.eos_ids)

    def accepted(text: str) -> bool:
        matcher = cache.matcher(ToolConstraint([tool], "required", "llama3"))
        return all(
            matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)
        )

    assert accepted('{"name": "f", "parameters": {"s": "ab"}}')
    assert not accepted('{"name": "f", "parameters": {"s": "a\tb"}}')
    assert not accepted('{"name": "f", "parameters": {"s": "abcdefg"}}')
