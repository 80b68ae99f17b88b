"""`looprl.apps.inference`: chat on a model or a run, forced calls, batching, variants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from looprl.apps.inference import ChatModel
from looprl.apps.loading import load_chat_model
from looprl.config import config_from_dict, to_yaml
from looprl.errors import RequestError
from looprl.loop.checkpoint import trainable_state
from looprl.loop.policy import load_policy
from looprl.openai.wire import ChatRequest
from looprl.types import Message, ToolCall

SQUARE = {
    "type": "function",
    "function": {
        "name": "choose_square",
        "description": "Put your mark on a square.",
        "parameters": {
            "type": "object",
            "properties": {"square": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["square"],
        },
    },
}
RESIGN = {
    "type": "function",
    "function": {
        "name": "resign",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
TOOLS = [SQUARE, RESIGN]
HI = [Message(role="user", content="Your move.")]


@pytest.fixture(scope="module")
def model() -> ChatModel:
    return load_chat_model("tiny-random", device="cpu")


def count_engine_calls(monkeypatch, engine) -> list[int]:
    calls: list[int] = []
    real = engine.generate

    def counting(requests, params):
        calls.append(len(requests))
        return real(requests, params)

    monkeypatch.setattr(engine, "generate", counting)
    return calls


def test_plain_chat(model):
    assert model.name == "tiny-random" and model.variants == ("base",)
    choices = model.chat(HI, n=3, max_tokens=12, seed=0)
    assert len(choices) == 3
    for c in choices:
        assert c.prompt_ids == model.renderer.prompt_ids(HI, None)
        assert len(c.completion_ids) == len(c.logprobs) <= 12
        assert c.finish_reason in ("stop", "length")
        assert c.message.role == "assistant" and c.message.content == c.text
        assert all(lp <= 0 for lp in c.logprobs)


@pytest.mark.parametrize("tool_choice", ["required", "choose_square", "resign"])
def test_forced_calls_always_parse(model, tool_choice):
    choices = model.chat(HI, TOOLS, tool_choice, n=6, temperature=1.0, max_tokens=64, seed=1)
    for c in choices:
        assert c.finish_reason == "tool_calls", c.text
        assert c.message.parse_failure is None
        (call,) = c.message.tool_calls
        assert call.id.startswith("call_")
        if tool_choice != "required":
            assert call.name == tool_choice
        if call.name == "choose_square":
            assert 1 <= call.arguments["square"] <= 9


def test_tool_choice_none_renders_no_tools(model):
    (c,) = model.chat(HI, TOOLS, "none", max_tokens=4)
    assert c.prompt_ids == model.renderer.prompt_ids(HI, None)
    assert "choose_square" not in model.tokenizer.decode(c.prompt_ids)
    (auto,) = model.chat(HI, TOOLS, "auto", max_tokens=4)
    assert "choose_square" in model.tokenizer.decode(auto.prompt_ids)


def test_seeded_requests_do_not_depend_on_the_batch(model):
    alone = model.chat(HI, n=2, max_tokens=10, seed=7)
    again = model.chat_many(
        [
            ChatRequest(messages=HI, max_tokens=10),
            ChatRequest(messages=HI, n=2, max_tokens=10, seed=7),
        ]
    )[1]
    assert [c.completion_ids for c in alone] == [c.completion_ids for c in again]
    assert [c.completion_ids for c in alone] != [
        c.completion_ids for c in model.chat(HI, n=2, max_tokens=10, seed=8)
    ]


def test_chat_many_shares_engine_calls(model, monkeypatch):
    calls = count_engine_calls(monkeypatch, model.engine)
    other = [Message(role="user", content="Something else, please.")]
    results = model.chat_many(
        [
            ChatRequest(messages=HI, max_tokens=6),
            ChatRequest(
                messages=other, tools=TOOLS, tool_choice="choose_square", n=2, max_tokens=40
            ),
            ChatRequest(messages=HI, max_tokens=6, temperature=0.0),  # other settings: own call
        ]
    )
    assert calls == [3, 1]
    assert [len(r) for r in results] == [1, 2, 1]
    assert all(c.message.tool_calls[0].name == "choose_square" for c in results[1])
    assert all(len(c.completion_ids) <= 6 for c in results[0] + results[2])


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(variant="baseline"), "model"),
        (dict(tools=TOOLS, tool_choice="fly"), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(n=0), "n"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(messages=[Message(role="robot", content="hi")]), "messages[0].role"),  # type: ignore[arg-type]
        (dict(messages=[]), "messages"),
        (dict(tools=[SQUARE, SQUARE]), "tools[1].function.name"),
        (
            dict(tools=[{"function": {"name": "f", "parameters": {"type": "nonsense"}}}]),
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_requests_name_the_field(model, kwargs, param):
    with pytest.raises(RequestError) as err:
        model.chat(**{"messages": HI, **kwargs})
    assert err.value.param == param, str(err.value)


def test_return_exceptions_keeps_the_good_requests(model):
    good, bad, odd = model.chat_many(
        [
            ChatRequest(messages=HI, max_tokens=3),
            ChatRequest(messages=HI, n=0),
            ChatRequest(prompt=[]),  # an empty raw prompt
        ],
        return_exceptions=True,
    )
    assert isinstance(good, list) and len(good) == 1
    assert isinstance(bad, RequestError) and isinstance(odd, RequestError)


def test_stop_strings_are_cut_off(model):
    (free,) = model.chat(HI, max_tokens=20, seed=0)
    word = free.text[8:11]
    assert len(word) == 3
    (cut,) = model.chat(HI, max_tokens=20, seed=0, stop=[word])
    assert word not in cut.text and cut.finish_reason == "stop"
    assert free.text.startswith(cut.text)


def test_multi_turn_tool_conversation_renders(model):
    history = HI + [
        Message(role="assistant", tool_calls=[ToolCall("choose_square", {"square": 5}, "c1")]),
        Message(role="tool", content="Board: ....X....", tool_call_id="c1", name="choose_square"),
    ]
    (c,) = model.chat(history, TOOLS, "required", max_tokens=64)
    prompt = model.tokenizer.decode(c.prompt_ids)
    assert '"square": 5' in prompt and "Board: ....X...." in prompt
    assert c.message.tool_calls


def test_prompt_longer_than_the_context_is_an_error(model):
    long = [Message(role="user", content="word " * 5000)]
    with pytest.raises(RequestError, match="shorten"):
        model.chat(long, max_tokens=4)


# ---------------------------------------------------------------- runs


def fake_run(root: Path, lora: bool, **sections: dict) -> Path:
    """A run folder whose checkpoint moved the weights far from the base model
    (`sections`: more of the run's config, e.g. rollout={...})."""
    model = {"name": "tiny-random", "device": "cpu", "lora": {"enabled": lora}}
    cfg = config_from_dict({**sections, "model": {**model, **sections.pop("model", {})}})
    policy = load_policy(cfg)
    state = trainable_state(policy.model)
    generator = torch.Generator().manual_seed(0)
    moved = {k: v + 0.5 * torch.randn(v.shape, generator=generator) for k, v in state.items()}
    ckpt = root / "checkpoints" / "step_000003"
    ckpt.mkdir(parents=True)
    save_file(moved, str(ckpt / "trainable.safetensors"))
    (ckpt / "meta.json").write_text(json.dumps({"step": 3}))
    (root / "config.yaml").write_text(to_yaml(cfg))
    return root


@pytest.mark.parametrize("lora", [True, False])
def test_run_serves_trained_and_baseline(model, tmp_path, lora):
    run = load_chat_model(str(fake_run(tmp_path / "myrun", lora)), device="cpu")
    assert run.name == "myrun" and run.variants == ("trained", "baseline")
    assert run.checkpoint == tmp_path / "myrun" / "checkpoints" / "step_000003"

    def logprobs(chat_model, variant=None):
        (c,) = chat_model.chat(HI, max_tokens=8, seed=3, variant=variant)
        return c.completion_ids, torch.tensor(c.logprobs)

    base_ids, base_lp = logprobs(model)
    ids, lp = logprobs(run, "baseline")
    assert ids == base_ids and torch.allclose(lp, base_lp, atol=1e-5)
    trained_ids, trained_lp = logprobs(run)  # the default variant is "trained"
    assert trained_ids != base_ids or not torch.allclose(trained_lp, base_lp, atol=1e-3)
    again_ids, again_lp = logprobs(run, "trained")  # baseline left the adapters on
    assert again_ids == trained_ids and torch.allclose(again_lp, trained_lp)


def test_baseline_engine_has_the_runs_settings(tmp_path):
    """A full fine-tune's baseline is a second model: its engine samples as the run's
    does (sampler dtype, cascade attention, weight-first and packed linear layers)."""
    model = {"cascade_attention": False, "weight_first_linear": False, "packed_linear": False}
    root = fake_run(tmp_path / "r", False, model=model, rollout={"sampler_dtype": "bfloat16"})
    run = load_chat_model(str(root), device="cpu")
    run.chat(HI, max_tokens=2, variant="baseline")
    baseline = run._baseline_engine
    assert baseline is not None and baseline.model is not run.engine.model
    for engine in (run.engine, baseline):
        assert engine.sampler_dtype == torch.bfloat16
        assert engine.cascade is False and engine.weight_first_linear is False
        assert engine.packed_linear is False
    defaults = load_chat_model(str(fake_run(tmp_path / "d", False)), device="cpu")
    defaults.chat(HI, max_tokens=2, variant="baseline")
    assert defaults._baseline_engine.sampler_dtype is None
    assert defaults._baseline_engine.weight_first_linear is True
    assert defaults._baseline_engine.packed_linear is True


def test_checkpoint_choice_and_errors(tmp_path):
    from looprl.errors import ConfigError

    run = fake_run(tmp_path / "r", lora=True)
    chosen = load_chat_model(str(run), checkpoint=Path("step_000003"), device="cpu")
    assert chosen.checkpoint == run / "checkpoints" / "step_000003"
    with pytest.raises(ConfigError, match="step_000003"):
        load_chat_model(str(run), checkpoint=Path("step_000009"), device="cpu")
    with pytest.raises(ConfigError, match="run folder"):
        load_chat_model("tiny-random", checkpoint=run / "checkpoints" / "step_000003")
