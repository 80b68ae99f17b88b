"""`looprl serve` stops the work nobody waits for: a non-streaming request whose client
goes away (the official client's timeout, or a raw socket closed) stops generating
within a decode step or two, on `/v1/chat/completions`, `/v1/completions` and
`/v1/responses` alike, behind the API key check. The signal is the batcher's count of
decode steps after the client left (deterministic: it does not depend on how busy the
CPU is), with the server's CPU time as a second, looser check."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlparse

import openai
import pytest
from serving_helpers import wait_until

from looprl.apps.loading import load_chat_model
from looprl.apps.serve import create_app, serving

KEY = "sekret"
MAX_TOKENS = 3000  # far more than a tiny model decodes in the second before the drop
# steps a cancelled request may still take after its client left: "a step or two", with
# room for a CPU so busy that the server's event loop waits its turn (without the
# cancelling, ~3000 steps follow)
STEPS_AFTER_DROP = 10
ENDPOINTS = ("chat/completions", "completions", "responses")
BODIES = {
    "chat/completions": {"messages": [{"role": "user", "content": "Tell me a story."}]},
    "completions": {"prompt": "Once upon a time"},
    "responses": {"input": "Tell me a story."},
}


@pytest.fixture(scope="module")
def app():
    return create_app(load_chat_model("tiny-random", device="cpu"), api_key=KEY)


@pytest.fixture(scope="module")
def url(app) -> Iterator[str]:
    with serving(app) as base:
        yield base


def body_for(endpoint: str) -> dict:
    limit = "max_output_tokens" if endpoint == "responses" else "max_tokens"
    return {"model": "tiny-random", **BODIES[endpoint], limit: MAX_TOKENS}


def ask(client: openai.OpenAI, endpoint: str) -> None:
    body = body_for(endpoint)
    if endpoint == "chat/completions":
        client.chat.completions.create(**body)
    elif endpoint == "completions":
        client.completions.create(**body)
    else:
        client.responses.create(**body)


def health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
        return json.loads(response.read())


def check_stopped(app, url: str, at_drop: int, cpu_at_drop: float) -> None:
    """The request's rows are gone, at most a few steps after the drop, and the server
    does (next to) nothing in the second after."""
    batcher = app.state.batcher
    assert wait_until(lambda: batcher.live_rows() == 0, timeout=30), "still generating"
    time.sleep(1.0)
    after = batcher.decode_steps - at_drop
    assert after <= STEPS_AFTER_DROP, f"{after} decode steps after the client left"
    cpu_s = time.process_time() - cpu_at_drop  # the server runs in this process
    assert cpu_s < 0.8, f"{cpu_s:.2f} CPU-s in the second after the client left"
    seen = health(url)
    assert (seen["live_rows"], seen["decode_steps"]) == (0, batcher.decode_steps)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_client_that_times_out_stops_the_generation(app, url, endpoint):
    batcher = app.state.batcher
    before = batcher.decode_steps
    impatient = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        ask(impatient, endpoint)
    at_drop, cpu_at_drop = batcher.decode_steps, time.process_time()
    assert at_drop > before  # it was generating when the client gave up
    check_stopped(app, url, at_drop, cpu_at_drop)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_closed_socket_stops_the_generation(app, url, endpoint):
    batcher = app.state.batcher
    before = batcher.decode_steps
    payload = json.dumps(body_for(endpoint)).encode()
    where = urlparse(url)
    head = (
        f"POST /v1/{endpoint} HTTP/1.1\r\nHost: {where.netloc}\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection((where.hostname, where.port)) as sock:
        sock.sendall(head.encode() + payload)
        assert wait_until(lambda: batcher.decode_steps > before + 5)  # decoding
    at_drop, cpu_at_drop = batcher.decode_steps, time.process_time()
    check_stopped(app, url, at_drop, cpu_at_drop)


def test_the_key_check_still_refuses_a_wrong_key_and_lets_health_through(url):
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as err:
        ask(wrong, "chat/completions")
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    assert health(url)["status"] == "ok"
