"""The hf engine's compiled decode step (`rollout.compile`, engine/compiled_step.py): the
same logits as the eager step within float tolerance, one graph for a batch's whole
decoding, and a seeded generate that samples the same tokens."""

from __future__ import annotations

import pytest
import torch

from looprl.engine import GenerationRequest, SamplingParams
from looprl.engine.compiled_step import COLUMN_MULTIPLE, CompiledStep
from looprl.engine.hf import HFEngine
from looprl.envs.builtin.tictactoe import TicTacToeMove
from looprl.forward.kv import merge
from looprl.forward.prefix import shared_prefill

CPU = torch.device("cpu")


def _prompts(renderer, n: int) -> list[list[int]]:
    env = TicTacToeMove(tool_choice="auto")
    return [
        renderer.prompt_ids(env.reset(task).messages, env.reset(task).tools)
        for task in env.tasks("train", n=n, seed=3)
    ]


def _running(model, prompts, room: int, multiple: int = 1):
    part = shared_prefill(model, prompts, 0, CPU, use_cascade=False)
    return merge([part], [torch.arange(len(prompts))], room, multiple=multiple)


@torch.inference_mode()
def test_compiled_logits_match_the_eager_step_in_one_graph(tiny_model, renderer):
    """Six decode steps fed the same tokens: the compiled step's logits and KV within
    1e-4 of the eager model call's (float32), and no step after the first compiles."""
    prompts = _prompts(renderer, 3)
    eager, fixed = _running(tiny_model, prompts, 8), _running(tiny_model, prompts, 8, 64)
    assert fixed.attention_CL.shape[1] % COLUMN_MULTIPLE == 0
    step = CompiledStep("on", CPU)
    tokens_C1 = eager.logits_CV.argmax(-1, keepdim=True)
    for n in range(6):
        for running in (eager, fixed):
            running.attention_CL[:, running.width] = 1
        assert step.applies(fixed, 1)
        with torch._dynamo.config.patch(error_on_recompile=n > 0):
            fixed.logits_CV = step.run(tiny_model, fixed, tokens_C1)
        out = tiny_model(
            input_ids=tokens_C1,
            attention_mask=eager.attention_CL[:, : eager.width + 1],
            position_ids=eager.next_pos_C[:, None],
            cache=eager.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        eager.cache, eager.logits_CV = out.cache, out.logits[:, -1].float()
        for running in (eager, fixed):
            running.width += 1
            running.next_pos_C = running.next_pos_C + 1
        torch.testing.assert_close(fixed.logits_CV, eager.logits_CV, rtol=0, atol=1e-4)
        tokens_C1 = eager.logits_CV.argmax(-1, keepdim=True)
    for mine, theirs in zip(fixed.cache.layers, eager.cache.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=0, atol=1e-5)
    assert step.shapes == 1 and step.compile_seconds > 0


def _requests(renderer) -> list[GenerationRequest]:
    """Four distinct prompts that share a long head, twice each (a group), with
    different limits, so that rows finish, leave and join at different steps."""
    prompts = _prompts(renderer, 4)
    assert len({tuple(p) for p in prompts}) == 4
    return [
        GenerationRequest(prompt, max_new_tokens=5 + 6 * (n % 3))
        for n, prompt in enumerate(prompts * 2)
    ]


@pytest.mark.parametrize("cascade_attention", [False, True])
def test_a_seeded_generate_samples_the_same_tokens_compiled(
    tiny_model, tokenizer, renderer, cascade_attention
):
    """compile on vs off: the same ids, logprobs within 1e-4. Without cascade attention
    (the shared head copied into every row) rows leave and join (batch 4 < 8 requests);
    with it, all 8 run in one batch that keeps the head once (a prefix), and that batch
    decodes eagerly."""
    requests = _requests(renderer)
    params = SamplingParams(temperature=1.0, max_new_tokens=32, seed=4)
    outs = {}
    for mode in ("off", "on"):
        engine = HFEngine(
            tiny_model,
            tokenizer,
            renderer.eos_ids,
            batch_size=8 if cascade_attention else 4,
            cascade_attention=cascade_attention,
            compile_step=mode,
        )
        outs[mode] = (engine.generate(requests, params), engine.compiled)
    (plain, _), (compiled, step) = outs["off"], outs["on"]
    assert [o.ids for o in compiled] == [o.ids for o in plain]
    for a, b in zip(compiled, plain):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
        assert a.finish_reason == b.finish_reason
    assert (step.shapes == 0) == cascade_attention  # a prefix: never compiled


def test_compile_mode_is_checked_and_auto_is_off_on_the_cpu():
    with pytest.raises(ValueError, match="compile mode 'fast'"):
        CompiledStep("fast", CPU)
    assert not CompiledStep("auto", CPU).on
    assert CompiledStep("auto", torch.device("cuda")).on
    assert CompiledStep("off", CPU).column_multiple == 1


def test_compile_with_another_engine_is_refused_at_load():
    from looprl.config import config_from_dict
    from looprl.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.compile=on compiles the hf engine"):
        config_from_dict({"rollout": {"engine": "vllm", "compile": "on"}})
    assert config_from_dict({"rollout": {"compile": "on"}}).rollout.compile == "on"


def test_the_compiled_step_samples_from_the_updated_weights(tokenizer, renderer):
    """The weights are the graph's inputs, not constants: after an in-place update (an
    optimizer step), the compiled engine samples what the eager one samples."""
    from looprl.model.load import load_causal_lm

    model = load_causal_lm("tiny-random", torch.float32).eval()
    requests = _requests(renderer)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=8)

    def generate(mode: str) -> list[list[int]]:
        engine = HFEngine(
            model, tokenizer, renderer.eos_ids, cascade_attention=False, compile_step=mode
        )
        return [o.ids for o in engine.generate(requests, params)]

    before = generate("on")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05, alpha=1.0)
    after = generate("on")
    assert after == generate("off")
    assert after != before
