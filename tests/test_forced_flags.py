"""Which tokens of a forced call its grammar left free: the `hf` engine records it as it
samples (`Completion.free`, `Turn.free`), and it is exactly what replaying the grammar
over the finished completion finds (`free_tokens`), whatever the call, thinking or not,
jump-forward or not; the decision view takes the recorded flags and replays only where
there are none."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from looprl.engine import GenerationRequest, JsonConstraint, SamplingParams, Thinking
from looprl.engine.grammar import allows_one_token
from looprl.engine.hf import HFEngine
from looprl.engine.requests import generation_request
from looprl.envs.builtin.extraction import Extraction
from looprl.envs.builtin.tictactoe import TicTacToeGame, TicTacToeMove
from looprl.loop.decisions import decision_view, free_tokens, grammar_masked
from looprl.loop.rollout import run_episodes
from looprl.loop.sft import demo_episode

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "people": {"type": "integer"}},
    "required": ["city", "people"],
}


@pytest.fixture(scope="module")
def engines(tiny_model, tokenizer, renderer):
    return {
        jump: HFEngine(tiny_model, tokenizer, renderer.eos_ids, jump_forward=jump)
        for jump in (True, False)
    }


@pytest.fixture(scope="module")
def calls(renderer):
    """(prompt, constraint) of each kind of forced reply: the square of tictactoe-move,
    the string arguments of an extraction, the square after tagged or plain thinking (cut
    by its token limit, the engine writing the closing), a JSON reply."""

    def forced(env, thinking=None):
        obs = env.reset(env.tasks("eval", n=1)[0])
        prompt = renderer.prompt_ids(obs.messages, obs.tools)
        request = generation_request(
            prompt, obs.tools, obs.tool_choice, renderer.format, thinking=thinking
        )
        return prompt, request.constraint

    square = forced(TicTacToeMove())
    return {
        "choose_square": square,
        "extraction": forced(Extraction()),
        "tagged_thinking": forced(TicTacToeMove(), Thinking("tagged", 6)),
        "plain_thinking": forced(TicTacToeMove(), Thinking("plain", 5)),
        "json_reply": (square[0], JsonConstraint(CITY)),
    }


@settings(max_examples=16)
@given(
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(
        ["choose_square", "extraction", "tagged_thinking", "plain_thinking", "json_reply"]
    ),  # fmt: skip
    jump=st.booleans(),
    top_k=st.sampled_from([0, 5]),
    greedy=st.booleans(),
)
def test_the_engines_flags_are_the_replayed_ones(
    engines, calls, tokenizer, kind, seed, jump, top_k, greedy
):
    engine = engines[jump]
    prompt, constraint = calls[kind]
    params = SamplingParams(
        temperature=0.0 if greedy else 1.0, top_k=top_k, max_new_tokens=48, seed=seed
    )
    # a free-text request alongside: it records nothing, and it changes no forced row
    requests = [GenerationRequest(prompt, constraint) for _ in range(3)]
    outs = engine.generate([*requests, GenerationRequest(prompt)], params)
    assert outs[-1].free is None
    grammars = engine.grammars()
    for out in outs[:-1]:
        assert out.free is not None and len(out.free) == len(out.ids)
        matcher = grammars.matcher(constraint)
        replayed = free_tokens(matcher, out.ids, tokenizer, grammars.info.vocab_size)
        assert out.free == replayed, tokenizer.decode(out.ids)
        if out.finish_reason == "stop":  # a whole call: a choice, and forced scaffolding
            assert 0 < sum(out.free) < len(out.free)


def test_a_square_is_one_free_token_among_forced_ones(engines, calls, tokenizer):
    prompt, constraint = calls["choose_square"]
    params = SamplingParams(temperature=1.0, max_new_tokens=80, seed=3)
    for jump, engine in engines.items():
        for out in engine.generate([GenerationRequest(prompt, constraint)] * 4, params):
            assert out.finish_reason == "stop"
            digits = [t for t, f in zip(out.ids, out.free) if f]
            assert len(digits) == 1 and tokenizer.decode(digits) in "123456789", jump


def test_turns_carry_the_flags_and_the_view_takes_them(tiny_model, tokenizer, renderer):
    """Multi-turn games on the hf engine: every turn's recorded flags are its replayed
    ones, and the decision view from them is the one the replay gives."""
    engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids)
    tasks = TicTacToeGame().tasks("eval", n=4)
    episodes = run_episodes(
        tasks, lambda: TicTacToeGame("random", "X"), engine, renderer,
        SamplingParams(temperature=1.0, max_new_tokens=48, seed=5), max_turns=4,
        max_episode_tokens=3000,
    )  # fmt: skip
    grammars = engine.grammars()
    assert sum(len(e.turns) for e in episodes) > len(episodes)  # several turns each
    for episode in episodes:
        for turn in episode.turns:
            matcher = grammars.matcher(turn.constraint)
            replayed = free_tokens(
                matcher, turn.completion_ids, tokenizer, grammars.info.vocab_size
            )
            assert turn.free == replayed
        unrecorded = replace(episode, turns=[replace(t, free=None) for t in episode.turns])
        view = decision_view(episode, grammars, tokenizer)
        assert view.loss_mask == decision_view(unrecorded, grammars, tokenizer).loss_mask


def test_grammar_masked_replays_only_turns_without_flags(engines, renderer, tokenizer):
    """A demonstration has no recorded flags: the grammar is replayed (its square's digit
    stays). Given flags, the mask is those flags, the grammar unasked."""
    grammars = engines[True].grammars()
    env = TicTacToeMove()
    task = env.tasks("train", n=1, seed=5)[0]
    episode = demo_episode(env, task, renderer)
    (turn,) = episode.turns
    assert turn.free is None
    start, n = len(turn.prompt_ids), len(turn.completion_ids)
    replayed = grammar_masked(episode, grammars, tokenizer)
    picked = [t for t, m in zip(episode.token_ids, replayed.loss_mask) if m]
    assert tokenizer.decode(picked) == str(
        env.demonstrations(task)[0].tool_calls[0].arguments["square"]
    )
    flags = [1] * n
    flags[0] = 0
    recorded = replace(episode, turns=[replace(turn, free=flags)])
    assert grammar_masked(recorded, grammars, tokenizer).loss_mask[start : start + n] == flags


@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=40), st.data())
def test_allows_one_token_counts_the_set_bits(words, data):
    # mostly sparse masks, where one set bit is likely
    zeroed = data.draw(st.lists(st.booleans(), min_size=len(words), max_size=len(words)))
    words = [0 if z else w for w, z in zip(words, zeroed)]
    if data.draw(st.booleans()):
        words = [0] * len(words)
        words[data.draw(st.integers(0, len(words) - 1))] = data.draw(
            st.sampled_from([1, 2, 1 << 30, -(2**31), 3, -1])
        )
    bits = sum(bin(w & 0xFFFFFFFF).count("1") for w in words)
    bitmask = torch.tensor(words, dtype=torch.int32)
    assert allows_one_token(bitmask) == (bits == 1)
