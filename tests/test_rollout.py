"""Rollouts: token/mask/logprob bookkeeping with a scripted engine, environment errors,
a fuzzed engine, and the real `hf` engine on the tiny random model."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from looprl.chat.formats import format_tool_call
from looprl.engine import Completion, GenerationRequest, SamplingParams, ToolConstraint
from looprl.engine.hf import HFEngine
from looprl.envs.builtin.tictactoe import (
    CHOOSE_SQUARE_TOOL,
    TicTacToeGame,
    TicTacToeMove,
    legal_moves,
    positions,
    winning_moves,
)
from looprl.loop.rollout import run_episodes
from looprl.types import ENV_ERROR, PARSE_FAILURES, TRUNCATED, Episode, Task, ToolCall

TOOLS = [CHOOSE_SQUARE_TOOL]
_BOARD = re.compile(
    r" (\S) \| (\S) \| (\S)\n---\+---\+---\n (\S) \| (\S) \| (\S)\n---\+---\+---\n"
    r" (\S) \| (\S) \| (\S)"
)


def call_text(square, name: str = "choose_square") -> str:
    return format_tool_call(ToolCall(name, {"square": square}), "hermes")


def last_board(text: str) -> str:
    """The last board rendered in `text` (squares shown by number are empty)."""
    cells = _BOARD.findall(text)[-1]
    return "".join("." if c.isdigit() else c for c in cells)


def fake_logprob(i: int) -> float:
    return -0.25 - (i % 5) / 10  # never 0, so masking mistakes show


class ScriptedEngine:
    """The engine protocol, answering each request with ids from `script(prompt_text)`."""

    def __init__(self, tokenizer, script: Callable[[str], list[int]]) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.calls: list[tuple[list[GenerationRequest], SamplingParams]] = []

    def generate(
        self, requests: list[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        self.calls.append((requests, params))
        out = []
        for request in requests:
            ids = list(self.script(self.tokenizer.decode(request.prompt_ids)))
            ids = ids[: min(params.max_new_tokens, request.max_new_tokens or params.max_new_tokens)]
            finish = "stop" if ids and ids[-1] == self.tokenizer.eos_token_id else "length"
            out.append(Completion(ids, [fake_logprob(i) for i in range(len(ids))], finish))
        return out

    def load_weights(self, state_dict=None) -> None:
        pass


def encode(tokenizer, text: str, eos: bool = True) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id] * eos


def check_alignment(ep: Episode) -> None:
    """Invariants every episode must satisfy, whatever the model wrote."""
    n = len(ep.token_ids)
    assert len(ep.loss_mask) == n and len(ep.logprobs) == n
    assert set(ep.loss_mask) <= {0, 1}
    for mask, lp in zip(ep.loss_mask, ep.logprobs, strict=True):
        assert (lp != 0.0) == (mask == 1)
    assert ep.response_len == sum(len(t.completion_ids) for t in ep.turns)
    generated: set[int] = set()
    for turn in ep.turns:
        start = len(turn.prompt_ids)
        assert ep.token_ids[:start] == turn.prompt_ids
        end = start + len(turn.completion_ids)
        assert ep.token_ids[start:end] == turn.completion_ids
        assert ep.logprobs[start:end] == turn.completion_logprobs
        generated.update(range(start, end))
    assert {i for i, m in enumerate(ep.loss_mask) if m} == generated


def winnable_tasks(n: int) -> list[Task]:
    boards = [b for b in positions(400, seed=7) if winning_moves(b, "X")][:n]
    return [Task(id=f"t{i}", data={"board": b}, seed=i) for i, b in enumerate(boards)]


# ------------------------------------------------------------------ scripted engine


def test_move_env_outcomes_for_scripted_outputs(tokenizer, renderer):
    tasks = winnable_tasks(7)
    boards = [t.data["board"] for t in tasks]
    texts = [
        call_text(winning_moves(boards[0], "X")[0]),
        "I think I will take the centre square.",
        '<tool_call>\n{"name": "choose_square", "arguments": {"square": 3}\n</tool_call>',
        call_text(3, name="pick_square"),
        call_text(42),
        call_text(boards[5].index("X") + 1),  # occupied
        call_text(winning_moves(boards[6], "X")[0]),
    ]
    eos = [True, True, True, True, True, True, False]  # the last one hit the token limit
    by_board = {b: encode(tokenizer, t, e) for b, t, e in zip(boards, texts, eos, strict=True)}
    engine = ScriptedEngine(tokenizer, lambda prompt: by_board[last_board(prompt)])
    params = SamplingParams(max_new_tokens=64, seed=5)
    episodes = run_episodes(tasks, TicTacToeMove, engine, renderer, params, 1, 2048)

    outcomes = [ep.outcome for ep in episodes]
    assert outcomes == [
        "win",
        "no_tool_call",
        "bad_json",
        "unknown_tool",
        "bad_arguments",
        "illegal",
        "win",
    ]
    assert [ep.reward for ep in episodes] == [1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0]
    assert [ep.task.id for ep in episodes] == [t.id for t in tasks]
    assert len(engine.calls) == 1  # one batched call for a one-turn env
    requests, used = engine.calls[0]
    assert used.seed == 5 and used.max_new_tokens == 64
    for request in requests:  # the env asks for a forced call
        assert request.constraint == ToolConstraint(TOOLS, "required", "hermes")
    for ep, text, board in zip(episodes, texts, boards, strict=True):
        check_alignment(ep)
        assert len(ep.turns) == 1
        assert ep.response_len == len(by_board[board])
        assert ep.turns[0].text == text
        env = TicTacToeMove()
        obs = env.reset(ep.task)
        prompt = renderer.prompt_ids(obs.messages, obs.tools)
        assert ep.token_ids == prompt + by_board[board]  # nothing appended after the end
        assert ep.messages[:2] == obs.messages
        assert ep.messages[-1].role == "assistant"
        assert ep.trainable and ep.error is None
    assert episodes[0].messages[-1].tool_calls[0].name == "choose_square"
    assert episodes[6].turns[0].finish_reason == "length"


def lowest_legal(tokenizer, eos: bool = True) -> Callable[[str], list[int]]:
    return lambda prompt: encode(tokenizer, call_text(legal_moves(last_board(prompt))[0]), eos)


@pytest.mark.parametrize("eos", [True, False], ids=["eos", "no-eos"])
def test_game_env_multi_turn_episode_is_the_rendered_conversation(tokenizer, renderer, eos):
    env = TicTacToeGame(opponent="random", agent_plays="X")
    tasks = env.tasks("eval", n=4)
    engine = ScriptedEngine(tokenizer, lowest_legal(tokenizer, eos))
    make = lambda: TicTacToeGame(opponent="random", agent_plays="X")  # noqa: E731
    params = SamplingParams(max_new_tokens=64, seed=11)
    episodes = run_episodes(tasks, make, engine, renderer, params, 5, 4096)
    for ep in episodes:
        assert ep.outcome in ("win", "draw", "loss"), ep.outcome
        assert len(ep.turns) >= 3
        check_alignment(ep)
        # the ids are exactly the template's rendering of the conversation so far: the
        # final tool message was never appended, the end marker of a call without EOS was
        assert ep.messages[-1].role == "tool"
        expected = renderer.render_text(ep.messages[:-1], TOOLS, add_generation_prompt=False)
        suffix = "\n" if eos else "<|im_end|>\n"
        assert tokenizer.decode(ep.token_ids) + suffix == expected
        assert [m.role for m in ep.messages].count("assistant") == len(ep.turns)
    # per-turn seeds differ; the token budget never cut a call short
    seeds = [p.seed for _, p in engine.calls]
    assert seeds[:3] == [11, 11 + 7919, 11 + 2 * 7919]
    assert all(r.max_new_tokens == 64 for requests, _ in engine.calls for r in requests)


def test_game_truncated_by_turn_and_token_limits(tokenizer, renderer):
    make = lambda: TicTacToeGame(opponent="random", agent_plays="X")  # noqa: E731
    tasks = make().tasks("eval", n=3)
    engine = ScriptedEngine(tokenizer, lowest_legal(tokenizer))
    params = SamplingParams(max_new_tokens=64)
    by_turns = run_episodes(tasks, make, engine, renderer, params, 2, 4096)
    for ep in by_turns:  # X needs at least 3 moves to win
        assert ep.outcome == TRUNCATED
        assert len(ep.turns) == 2
        assert ep.messages[-1].role == "tool"  # the env's last reply is kept in the transcript
        check_alignment(ep)

    prompt_len = len(by_turns[0].turns[0].prompt_ids)
    limit = prompt_len + 40  # room for the first call only
    by_tokens = run_episodes(tasks, make, engine, renderer, params, 5, limit)
    for ep in by_tokens:
        assert ep.outcome == TRUNCATED
        check_alignment(ep)
        assert len(ep.turns) == 1
    assert all(r.max_new_tokens == 40 for r in engine.calls[-1][0])


def test_illegal_move_mid_game(tokenizer, renderer):
    make = lambda: TicTacToeGame(opponent="random", agent_plays="X")  # noqa: E731
    state = {"n": 0}

    def script(prompt: str) -> list[int]:
        state["n"] += 1
        board = last_board(prompt)
        if state["n"] == 1:
            return encode(tokenizer, call_text(legal_moves(board)[0]))
        return encode(tokenizer, call_text(board.index("X") + 1))  # own mark: occupied

    episodes = run_episodes(
        make().tasks("eval", n=1), make, ScriptedEngine(tokenizer, script), renderer,
        SamplingParams(), 5, 4096,
    )  # fmt: skip
    (ep,) = episodes
    assert ep.outcome == "illegal" and ep.reward == -1.0
    assert len(ep.turns) == 2
    assert ep.info["failure"] == "occupied"
    check_alignment(ep)


class FlakyMove(TicTacToeMove):
    """Raises in `step` (or `reset`) for chosen tasks: a buggy user environment."""

    def __init__(self, bad_step: set[str], bad_reset: set[str]) -> None:
        super().__init__()
        self.bad_step, self.bad_reset = bad_step, bad_reset
        self.task_id = ""

    def reset(self, task):
        if task.id in self.bad_reset:
            raise KeyError(f"reset exploded on {task.id}")
        self.task_id = task.id
        return super().reset(task)

    def step(self, message):
        if self.task_id in self.bad_step:
            raise ZeroDivisionError(f"step exploded on {self.task_id}")
        return super().step(message)


def test_env_errors_only_end_their_own_episodes(tokenizer, renderer):
    tasks = winnable_tasks(6)
    engine = ScriptedEngine(
        tokenizer,
        lambda p: encode(tokenizer, call_text(winning_moves(last_board(p), "X")[0])),
    )
    make = lambda: FlakyMove(bad_step={"t1", "t4"}, bad_reset={"t2"})  # noqa: E731
    episodes = run_episodes(tasks, make, engine, renderer, SamplingParams(), 1, 2048)
    assert [ep.outcome for ep in episodes] == [
        "win",
        ENV_ERROR,
        ENV_ERROR,
        "win",
        ENV_ERROR,
        "win",
    ]
    assert len(engine.calls[0][0]) == 5  # the episode whose reset failed asks for nothing
    for i in (1, 4):
        ep = episodes[i]
        assert "Traceback" in ep.error and f"ZeroDivisionError: step exploded on t{i}" in ep.error
        assert not ep.trainable and ep.reward == 0.0
        assert ep.response_len > 0
        check_alignment(ep)
    assert "KeyError" in episodes[2].error and "reset exploded on t2" in episodes[2].error
    assert episodes[2].token_ids == [] and not episodes[2].trainable
    for i in (0, 3, 5):
        assert episodes[i].error is None and episodes[i].trainable
        assert episodes[i].reward == 1.0


# ------------------------------------------------------------------ fuzzed engine

VOCAB = 49152
_SPECIAL = st.sampled_from([0, 1, 2])
_TOKEN = st.one_of(st.integers(0, VOCAB - 1), _SPECIAL)


def _fuzz_ids(tokenizer):
    """Per model call: arbitrary ids, a (possibly cut or padded) call, or a legal move
    (an int: which of the board's legal squares), so games also run for several turns."""
    call = st.builds(
        lambda square, eos, cut: encode(tokenizer, call_text(square), eos)[:cut],
        st.one_of(st.integers(1, 9), st.integers(-3, 50)),
        st.booleans(),
        st.one_of(st.none(), st.integers(0, 40)),
    )
    legal = st.integers(0, 8)
    return st.one_of(
        legal,
        st.just([]),
        st.lists(_TOKEN, max_size=300),
        legal,
        st.lists(_SPECIAL, max_size=5),
        call,
        legal,
        st.builds(lambda a, b: a + b, call, st.lists(_TOKEN, max_size=20)),
    )


def _fuzz_script(tokenizer, data):
    strategy = _fuzz_ids(tokenizer)

    def script(prompt: str) -> list[int]:
        drawn = data.draw(strategy)
        if isinstance(drawn, int):
            moves = legal_moves(last_board(prompt))
            return encode(tokenizer, call_text(moves[drawn % len(moves)]))
        return drawn

    return script


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    data=st.data(),
    game=st.booleans(),
    max_episode_tokens=st.sampled_from([320, 500, 4096]),
    max_new_tokens=st.sampled_from([16, 300]),
)
def test_fuzzed_engine_never_breaks_a_rollout(
    tokenizer, renderer, data, game, max_episode_tokens, max_new_tokens
):
    engine = ScriptedEngine(tokenizer, _fuzz_script(tokenizer, data))
    if game:
        make = lambda: TicTacToeGame(opponent="random", agent_plays="alternate")  # noqa: E731
        tasks = make().tasks("eval", n=3)
    else:
        make = TicTacToeMove
        tasks = make().tasks("eval", n=3)
    env = make()
    params = SamplingParams(max_new_tokens=max_new_tokens, seed=0)
    episodes = run_episodes(
        tasks, make, engine, renderer, params, env.max_turns, max_episode_tokens
    )
    allowed = set(env.outcomes) | set(PARSE_FAILURES) | {TRUNCATED}
    for ep in episodes:
        assert ep.outcome in allowed, (ep.outcome, ep.error)
        assert ep.error is None
        assert 1 <= len(ep.turns) <= env.max_turns
        check_alignment(ep)
        for turn in ep.turns:
            assert len(turn.completion_ids) <= max_new_tokens
    event(f"longest episode: {max(len(ep.turns) for ep in episodes)} turns")


# ------------------------------------------------------------------ real hf engine


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer, renderer):
    return HFEngine(tiny_model, tokenizer, renderer.eos_ids)


def full_forward_logprobs(model, prompt, completion, temperature=1.0) -> torch.Tensor:
    """log_softmax(logits / T) of a plain unpadded forward over prompt + completion, at
    the rows that predict the completion tokens ([len(completion), vocab])."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
    return torch.log_softmax(rows / temperature, dim=-1)


def random_prompts(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def at(logp: torch.Tensor, ids: list[int]) -> list[float]:
    return [logp[i, t].item() for i, t in enumerate(ids)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_logprobs_match_full_forward_with_left_padding(engine, tiny_model, temperature):
    prompts = random_prompts([5, 40, 17, 63, 1])
    params = SamplingParams(temperature=temperature, max_new_tokens=8, seed=3)
    out = engine.generate([GenerationRequest(p) for p in prompts], params)
    assert len(out) == len(prompts)
    for prompt, c in zip(prompts, out, strict=True):
        assert len(c.ids) == len(c.logprobs) == 8 and c.finish_reason == "length"
        ref = at(full_forward_logprobs(tiny_model, prompt, c.ids, temperature), c.ids)
        assert c.logprobs == pytest.approx(ref, abs=1e-4)


def test_hf_groups_of_identical_prompts(engine, tiny_model):
    """G samples of each task share a prompt: every row is still scored exactly and
    samples independently, in the caller's order."""
    a, b, c = random_prompts([6, 30, 14], seed=6)
    prompts = [a, b, a, c, b, a, a, c]
    out = engine.generate(
        [GenerationRequest(p) for p in prompts], SamplingParams(max_new_tokens=6, seed=21)
    )
    for prompt, x in zip(prompts, out, strict=True):
        ref = at(full_forward_logprobs(tiny_model, prompt, x.ids), x.ids)
        assert x.logprobs == pytest.approx(ref, abs=1e-4)
    same_prompt = [out[i].ids for i in (0, 2, 5, 6)]
    assert len({tuple(ids) for ids in same_prompt}) == 4
    greedy = engine.generate(
        [GenerationRequest(p) for p in prompts], SamplingParams(temperature=0, max_new_tokens=4)
    )
    single = {
        tuple(p): engine.generate(
            [GenerationRequest(p)], SamplingParams(temperature=0, max_new_tokens=4)
        )[0].ids
        for p in (a, b, c)
    }
    assert [g.ids for g in greedy] == [single[tuple(p)] for p in prompts]


def test_hf_same_seed_same_tokens(engine):
    reqs = [GenerationRequest(p) for p in random_prompts([9, 30, 4], seed=1)]
    a = engine.generate(reqs, SamplingParams(max_new_tokens=6, seed=42))
    b = engine.generate(reqs, SamplingParams(max_new_tokens=6, seed=42))
    c = engine.generate(reqs, SamplingParams(max_new_tokens=6, seed=43))
    assert [x.ids for x in a] == [x.ids for x in b]
    assert [x.logprobs for x in a] == [x.logprobs for x in b]
    assert [x.ids for x in a] != [x.ids for x in c]


def test_hf_greedy_is_deterministic_and_argmax(engine, tiny_model, tokenizer, renderer):
    prompts = random_prompts([12, 3, 25], seed=2)
    reqs = [GenerationRequest(p) for p in prompts]
    a = engine.generate(reqs, SamplingParams(temperature=0, max_new_tokens=6, seed=1))
    b = engine.generate(reqs, SamplingParams(temperature=0, max_new_tokens=6, seed=2))
    assert [x.ids for x in a] == [x.ids for x in b]
    # one request per batch: the same tokens, in the caller's order
    small = HFEngine(tiny_model, tokenizer, renderer.eos_ids, batch_size=1)
    c = small.generate(reqs, SamplingParams(temperature=0, max_new_tokens=6))
    assert [x.ids for x in a] == [x.ids for x in c]
    for prompt, x in zip(prompts, a, strict=True):
        logp = full_forward_logprobs(tiny_model, prompt, x.ids)
        best = logp.max(dim=-1).values.tolist()
        assert at(logp, x.ids) == pytest.approx(best, abs=1e-5)


def test_hf_top_k_top_p_filter_samples_but_not_logprobs(engine, tiny_model):
    prompts = random_prompts([7, 21], seed=5)
    reqs = [GenerationRequest(p) for p in prompts]
    top_k = engine.generate(reqs, SamplingParams(top_k=3, max_new_tokens=10, seed=8))
    tiny_p = engine.generate(reqs, SamplingParams(top_p=1e-6, max_new_tokens=10, seed=8))
    greedy = engine.generate(reqs, SamplingParams(temperature=0, max_new_tokens=10))
    for prompt, k, p, g in zip(prompts, top_k, tiny_p, greedy, strict=True):
        logp = full_forward_logprobs(tiny_model, prompt, k.ids)
        ranks = [(logp[i] > logp[i, t]).sum().item() for i, t in enumerate(k.ids)]
        assert max(ranks) < 3 and len(set(k.ids)) > 1
        assert k.logprobs == pytest.approx(at(logp, k.ids), abs=1e-4)  # unfiltered
        assert p.ids == g.ids  # a vanishing nucleus keeps only the top token


def test_hf_stops_on_stop_tokens_and_strings(engine, tiny_model, tokenizer, renderer):
    prompt = random_prompts([10], seed=4)[0]
    params = SamplingParams(max_new_tokens=8, seed=123)  # same seed: same tokens up to a stop
    (ref,) = engine.generate([GenerationRequest(prompt)], params)
    assert ref.finish_reason == "length" and len(set(ref.ids)) == 8
    stopper = HFEngine(tiny_model, tokenizer, renderer.eos_ids + [ref.ids[3]])
    (short,) = stopper.generate([GenerationRequest(prompt)], params)
    assert short.ids == ref.ids[:4] and short.finish_reason == "stop"

    k = next(
        i
        for i in range(1, len(ref.ids))
        if (s := tokenizer.decode(ref.ids[i : i + 1])).strip()
        and "\ufffd" not in s
        and s not in tokenizer.decode(ref.ids[:i])
    )
    stop = tokenizer.decode(ref.ids[k : k + 1])
    (cut,) = engine.generate([GenerationRequest(prompt)], replace(params, stop=[stop]))
    assert cut.ids == ref.ids[: k + 1] and cut.finish_reason == "stop"


@pytest.mark.parametrize("choice", ["required", "choose_square"])
def test_hf_forced_tool_call_is_always_valid(engine, tiny_model, renderer, tokenizer, choice):
    env = TicTacToeMove()
    prompts = [
        renderer.prompt_ids(obs.messages, obs.tools)
        for obs in (env.reset(t) for t in env.tasks("eval", n=8))
    ]
    constraint = ToolConstraint(TOOLS, choice, "hermes")
    reqs = [GenerationRequest(p, constraint) for p in prompts]
    reqs.append(GenerationRequest(prompts[0]))  # an unconstrained row in the same batch
    out = engine.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=64, seed=9))
    squares = set()
    for prompt, c in zip(prompts, out[:8], strict=True):
        assert c.finish_reason == "stop" and c.ids[-1] == tokenizer.eos_token_id
        parsed = renderer.parse(renderer.decode(c.ids), TOOLS)
        assert parsed.failure is None, parsed.detail
        assert len(parsed.calls) == 1 and parsed.calls[0].name == "choose_square"
        square = parsed.calls[0].arguments["square"]
        assert isinstance(square, int) and 1 <= square <= 9
        squares.add(square)
        # the recorded logprob is the policy's unconstrained one
        ref = at(full_forward_logprobs(tiny_model, prompt, c.ids), c.ids)
        assert c.logprobs == pytest.approx(ref, abs=1e-4)
    assert len(squares) > 1  # the square is sampled, not fixed by the grammar
    free = out[8]
    assert renderer.parse(renderer.decode(free.ids), TOOLS).failure == "no_tool_call"
    ref = at(full_forward_logprobs(tiny_model, prompts[0], free.ids), free.ids)
    assert free.logprobs == pytest.approx(ref, abs=1e-4)


def test_hf_rollout_with_forced_calls_only_yields_move_outcomes(engine, renderer):
    tasks = TicTacToeMove().tasks("eval", n=6)
    params = SamplingParams(temperature=1.0, max_new_tokens=64, seed=0)
    episodes = run_episodes(tasks, TicTacToeMove, engine, renderer, params, 1, 2048)
    for ep in episodes:
        assert ep.outcome in ("win", "optimal", "legal", "illegal")
        assert ep.messages[-1].tool_calls
        n = len(ep.turns[0].completion_ids)
        assert ep.loss_mask[-n:] == [1] * n and ep.response_len == n
        check_alignment(ep)


def test_update_scores_each_episode_at_its_own_sampling_temperature(
    engine, tiny_model, tokenizer, renderer, monkeypatch
):
    """One batch of episodes sampled at T = 0.5, 1 and 0 (greedy, scored at T = 1): the
    trainer's old logprobs reproduce the engine's for every one of them."""
    import looprl.loop.update as update
    from looprl.config import AlgoConfig, TrainConfig
    from looprl.loop.groups import Group
    from looprl.loop.policy import Policy

    batch = []
    for temperature in (0.5, 1.0, 0.0):
        params = SamplingParams(temperature=temperature, max_new_tokens=12, seed=4)
        episodes = run_episodes(winnable_tasks(2), TicTacToeMove, engine, renderer, params, 1, 512)
        assert [e.temperature for e in episodes] == [temperature] * 2
        batch += [Group(e.task, [e], [1.0]) for e in episodes]
    policy = Policy(tiny_model, tokenizer, renderer, engine, torch.device("cpu"))
    optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=0.0)  # weights stay

    def gap() -> float:
        state = update.UpdateState(micro_batch_tokens=1 << 16)  # one micro-batch, if allowed
        stats = update.update_policy(
            policy, optimizer, batch, AlgoConfig(num_minibatches=1), TrainConfig(),
            group_size=2, max_tokens=12, seed=0, state=state,
        )  # fmt: skip
        return stats["logprob_gap"]

    training = tiny_model.training
    try:
        assert gap() < 1e-4
        monkeypatch.setattr(update, "scoring_temperature", lambda t: 1.0)  # one T for all
        assert gap() > 1e-3
    finally:
        tiny_model.train(training)


def test_micro_batches_never_mix_temperatures(tokenizer):
    from looprl.forward.score import micro_batches
    from looprl.loop.batches import scoring_keys

    def episode(temperature: float) -> Episode:
        ids = [1, 2, 3, 4]
        return Episode(Task("t", {}), [], ids, [0, 0, 1, 1], [0.0] * 4, temperature=temperature)

    episodes = [episode(t) for t in (1.0, 1.0, 0.5, 0.5, 1.0)]
    chunks = micro_batches(*scoring_keys(episodes), token_budget=1_000)
    temperatures = [[episodes[i].temperature for i in chunk] for chunk in chunks]
    assert temperatures == [[1.0, 1.0], [0.5, 0.5], [1.0]]
    assert [len(c) for c in micro_batches(*scoring_keys(episodes[:2]), token_budget=1_000)] == [2]
    # greedy episodes are scored at T = 1: they share a micro-batch with those sampled at 1
    mixed = [episode(t) for t in (1.0, 0.0, 1.0, 0.5)]
    assert [len(c) for c in micro_batches(*scoring_keys(mixed), token_budget=1_000)] == [3, 1]
