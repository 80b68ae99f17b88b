"""`looprl serve`'s continuous batching through the real server and the official client:
a request joins a running generation at the next step, per-request sampling settings
share one batch without changing a seeded reply, a client that goes away frees its
rows, long prompts are prefilled in chunks between decode steps, and the variants of a
LoRA run take turns."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import openai
import pytest
from serving_helpers import wait_until

from looprl.apps.inference import ChatModel
from looprl.apps.loading import load_chat_model
from looprl.apps.serve import create_app, serving
from looprl.config import config_from_dict
from looprl.loop.policy import load_policy

HI = [{"role": "user", "content": "Tell me a story."}]
CHUNK = 64  # prefill chunk of the server under test: small, so a test prompt spans several


def client_for(url: str, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout)


@pytest.fixture(scope="module")
def model() -> ChatModel:
    return load_chat_model("tiny-random", device="cpu")


@pytest.fixture(scope="module")
def app(model):
    return create_app(model, prefill_chunk_tokens=CHUNK)


@pytest.fixture(scope="module")
def url(app) -> Iterator[str]:
    with serving(app) as base:
        yield base


def long_request(client, out: dict, max_tokens: int = 300, model: str = "tiny-random") -> None:
    start = time.monotonic()
    reply = client.chat.completions.create(
        model=model, messages=HI, max_tokens=max_tokens, seed=0, stop=None
    )
    out["reply"], out["start"], out["end"] = reply, start, time.monotonic()


def tokens_of(choice) -> list[str]:
    return [entry.token for entry in choice.logprobs.content]


def test_a_short_request_finishes_long_before_a_running_long_one(app, url):
    client, batcher = client_for(url), app.state.batcher
    long: dict = {}
    thread = threading.Thread(target=long_request, args=(client, long))
    thread.start()
    assert wait_until(lambda: batcher.live_rows() == 1)
    start = time.monotonic()
    short = client.chat.completions.create(model="tiny-random", messages=HI, max_tokens=2)
    short_s = time.monotonic() - start
    assert batcher.live_rows() == 1  # the long one is still generating
    thread.join(timeout=300)
    assert short.usage.completion_tokens == 2
    assert long["reply"].choices[0].finish_reason == "length"  # it ran its 300 tokens
    long_s = long["end"] - long["start"]
    assert start + short_s < long["end"]
    assert short_s < 0.5 * long_s, (short_s, long_s)


def test_per_request_settings_in_one_batch_give_the_same_tokens_as_alone(app, url):
    client, batcher = client_for(url), app.state.batcher
    asks = [
        dict(temperature=0.7, top_p=0.9, seed=5, max_tokens=12),
        dict(temperature=1.3, seed=6, max_tokens=9, n=2, stop=["e"]),
        dict(temperature=0.0, max_tokens=7),
    ]

    def ask(kwargs: dict) -> list[list[str]]:
        reply = client.chat.completions.create(
            model="tiny-random", messages=HI, logprobs=True, **kwargs
        )
        return [tokens_of(choice) for choice in reply.choices]

    alone = [ask(kwargs) for kwargs in asks]
    long: dict = {}
    thread = threading.Thread(target=long_request, args=(client, long, 200))
    thread.start()
    assert wait_until(lambda: batcher.live_rows() == 1)
    together: list = [None] * len(asks)
    threads = [
        threading.Thread(target=lambda i=i: together.__setitem__(i, ask(asks[i])))
        for i in range(len(asks))
    ]
    for t in threads:
        t.start()
    for t in threads + [thread]:
        t.join(timeout=300)
    assert together == alone
    assert alone[0] != alone[1][:1]  # the settings and seeds do matter


def test_a_closed_stream_frees_its_rows(app, url):
    client, batcher = client_for(url), app.state.batcher
    stream = client.chat.completions.create(
        model="tiny-random", messages=HI, max_tokens=2000, stream=True
    )
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen >= 3:
            break
    assert batcher.live_rows() == 1
    stream.close()
    assert wait_until(lambda: batcher.live_rows() == 0, timeout=30)
    start = time.monotonic()
    client.chat.completions.create(model="tiny-random", messages=HI, max_tokens=2)
    assert time.monotonic() - start < 30


def test_a_client_that_times_out_frees_its_rows(model, app, url):
    batcher = app.state.batcher
    impatient = client_for(url, timeout=1.0)
    # the reply cannot end early: an end token drawn within the second would not time out
    never_stop = {str(t): -100 for t in model.engine.stop_token_ids}
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(
            model="tiny-random", messages=HI, max_tokens=3000, logit_bias=never_stop
        )
    assert wait_until(lambda: batcher.live_rows() == 0, timeout=30)


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(model, app, url):
    client, batcher = client_for(url), app.state.batcher
    passes: list[int] = []  # tokens per row of each forward pass, in order
    hook = model.engine.model.register_forward_hook(
        lambda m, a, kw, out: passes.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        long: dict = {}
        thread = threading.Thread(target=long_request, args=(client, long, 300))
        thread.start()
        assert wait_until(lambda: batcher.live_rows() == 1)
        words = " ".join(f"word{i}" for i in range(200))
        reply = client.chat.completions.create(
            model="tiny-random", messages=[{"role": "user", "content": words}], max_tokens=3
        )
        thread.join(timeout=300)
    finally:
        hook.remove()
    assert reply.usage.prompt_tokens > 6 * CHUNK
    chunks = [i for i, n in enumerate(passes) if n == CHUNK]
    assert len(chunks) >= reply.usage.prompt_tokens // CHUNK
    assert max(passes) <= max(CHUNK, long["reply"].usage.prompt_tokens)
    between = [passes[a + 1 : b] for a, b in zip(chunks, chunks[1:])]
    assert all(1 in steps for steps in between), between  # decode steps in between


def lora_model() -> ChatModel:
    """tiny-random with LoRA adapters served as a run: "trained" and "baseline" (the
    adapters off) cannot share a forward pass."""
    cfg = config_from_dict(
        {"model": {"name": "tiny-random", "device": "cpu", "lora": {"enabled": True}}}
    )
    policy = load_policy(cfg)
    policy.model.eval()
    return ChatModel("tinyrun", policy, cfg, ("trained", "baseline"))


def test_variants_take_turns_and_neither_starves():
    """A baseline request keeps finishing while trained requests arrive without pause,
    and the trained ones keep finishing while it runs."""
    model = lora_model()
    app = create_app(model)
    with serving(app) as base:
        client = client_for(base)
        stop = threading.Event()
        finished: list[float] = []

        def steady() -> None:
            while not stop.is_set():
                client.chat.completions.create(model="tinyrun:trained", messages=HI, max_tokens=8)
                finished.append(time.monotonic())

        streams = [threading.Thread(target=steady) for _ in range(2)]
        for t in streams:
            t.start()
        assert wait_until(lambda: len(finished) >= 2)
        long: dict = {}
        long_request(client, long, 120, model="tinyrun:baseline")
        stop.set()
        for t in streams:
            t.join(timeout=120)
    assert long["reply"].system_fingerprint == "looprl-baseline"
    assert long["reply"].usage.completion_tokens == 120
    during = [t for t in finished if long["start"] < t < long["end"]]
    assert len(during) >= 3  # the trained requests went on meanwhile


def test_a_prompt_surely_over_the_context_is_refused_before_tokenizing(model, url):
    longest = max(map(len, model.tokenizer.get_vocab()))
    text = "word " * (model.context_length * longest // 5 + 100)
    with pytest.raises(openai.BadRequestError, match="at least"):
        client_for(url).chat.completions.create(
            model="tiny-random", messages=[{"role": "user", "content": text}], max_tokens=2
        )
