"""`looprl play --web`: the JSON endpoints with a scripted model, and the page driven in
headless Chromium (Playwright) against a scripted model and against tiny-random."""

from __future__ import annotations

import json
import shutil
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from looprl.apps.play import PlaySession, check_variant
from looprl.apps.play_web import PlayServer
from tests.test_play import ScriptedModel

CHROMIUM = "/usr/bin/chromium"


@contextmanager
def serving(model: Any, **defaults: Any) -> Iterator[PlayServer]:
    defaults = {"human": "X", "variant": check_variant(model, None), "temperature": 0.0,
                "seed": None, **defaults}  # fmt: skip
    server = PlayServer(model, 0, **defaults)  # port 0: any free port
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def request(
    server: PlayServer, path: str, body: Any = None, headers: dict | None = None
) -> tuple[int, dict[str, str], Any]:
    """(status, headers, body as JSON or text) of a GET (body None) or a JSON POST."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json"} if body is not None else {}
    req = urllib.request.Request(server.url + path.lstrip("/"), data, {**hdrs, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as res:
            status, head, payload = res.status, dict(res.headers), res.read().decode()
    except urllib.error.HTTPError as err:
        status, head, payload = err.code, dict(err.headers), err.read().decode()
    is_json = head.get("Content-Type") == "application/json"
    return status, head, json.loads(payload) if is_json else payload


# ============================================================================ the endpoints


def test_new_game_and_moves_over_json():
    model = ScriptedModel([4, 5], variants=("trained", "baseline"))
    with serving(model) as server:
        status, _, info = request(server, "/api/info")
        assert status == 200
        assert info == {"model": "scripted", "variants": ["trained", "baseline"],
                        "variant": "trained", "human": "X"}  # fmt: skip
        status, _, game = request(server, "/api/new", {"human": "X", "variant": "baseline"})
        assert status == 200 and game["board"] == "." * 9 and game["status"] == "human_to_move"
        status, _, game = request(server, "/api/move", {"id": game["id"], "square": 1})
        assert status == 200 and game["board"] == "X..O....."
        assert '"square": 4' in game["model_call"]
        assert game["turns"][0]["variant"] == "baseline" and model.calls[0]["variant"] == "baseline"
        status, _, refused = request(server, "/api/move", {"id": game["id"], "square": 4})
        assert status == 400 and refused == {"error": "square 4 is taken; empty squares: "
                                             "2, 3, 5, 6, 7, 8, 9"}  # fmt: skip


def test_the_model_opens_when_the_human_plays_o():
    with serving(ScriptedModel([5])) as server:
        _, _, game = request(server, "/api/new", {"human": "O"})
        assert game["board"] == "....X...." and game["model_mark"] == "X"
        assert game["status"] == "human_to_move" and len(game["turns"]) == 1


def test_errors_answer_with_a_status_and_a_message():
    with serving(ScriptedModel([])) as server:
        assert request(server, "/api/move", {"id": "nope", "square": 1})[0] == 404
        assert request(server, "/api/new", {"variant": "trained"})[2]["error"].startswith(
            "--variant trained: scripted has the variants base"
        )
        assert request(server, "/api/new", b"{not json")[0] == 400
        assert request(server, "/api/new", b"[1]")[0] == 400
        assert request(server, "/api/new", b"{}", {"Content-Type": "text/plain"})[0] == 415
        assert request(server, "/api/info", headers={"Host": "evil.example:80"})[0] == 403
        assert request(server, "/nothing")[0] == 404


def test_the_page_is_self_contained():
    with serving(ScriptedModel([])) as server:
        status, headers, page = request(server, "/")
    assert status == 200 and "default-src 'none'" in headers["Content-Security-Policy"]
    assert "<script src" not in page and "http://" not in page and "https://" not in page


# ============================================================================ in a browser


@pytest.fixture(scope="module")
def browser():
    if shutil.which(CHROMIUM) is None:
        pytest.skip(f"Chromium is not installed at {CHROMIUM} (Debian: apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@contextmanager
def open_page(browser: Any, server: PlayServer) -> Iterator[Any]:
    """The page, loaded; fails the test on any console error or uncaught exception."""
    page = browser.new_page()
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda err: errors.append(str(err)))
    page.goto(server.url)
    page.wait_for_selector("#board button >> nth=8")
    try:
        yield page
    finally:
        page.close()
    assert errors == [], errors


def test_page_switches_variants_and_shows_a_forfeit(browser):
    from playwright.sync_api import expect

    model = ScriptedModel([5, 1, 2], variants=("trained", "baseline"))
    with serving(model) as server, open_page(browser, server) as page:
        assert page.is_visible("#variant-switch") and page.input_value("#variant") == "trained"
        page.click('[data-square="1"]')
        page.wait_for_selector("#log li")
        assert page.text_content('[data-square="5"]') == "O"
        assert "model (O, trained): plays 5" in page.inner_text("#log")
        page.select_option("#variant", "baseline")  # a new game against the baseline
        expect(page.locator("#log li")).to_have_count(0)
        page.click('[data-square="1"]')  # the model answers 1: occupied, it forfeits
        page.wait_for_selector("#log li.illegal")
        assert "illegal move (occupied), forfeits" in page.inner_text("#log")
        assert "forfeits: you win" in page.inner_text("#status")
        assert page.is_disabled('[data-square="9"]')  # the game is over
        page.select_option("#human", "O")  # a new game: the model (baseline) opens
        expect(page.locator('[data-square="2"]')).to_have_text("X")
    assert [c["variant"] for c in model.calls] == ["trained", "baseline", "baseline"]


@pytest.fixture(scope="module")
def tiny_model():
    from looprl.apps.loading import load_chat_model

    return load_chat_model("tiny-random", device="cpu")


def test_page_plays_against_tiny_random(browser, tiny_model):
    # tiny-random is greedy here, so its answer to each first move is fixed; it may pick an
    # occupied square (and forfeit), so click a square it answers legally
    square = next(
        s
        for s in range(1, 10)
        if PlaySession(tiny_model).human_move(s).legal  # type: ignore[union-attr]
    )
    with serving(tiny_model) as server, open_page(browser, server) as page:
        assert page.is_hidden("#variant-switch")  # a plain model has one variant
        page.click(f'[data-square="{square}"]')
        page.wait_for_selector("#log li .call")
        cells = page.locator("#board button").all_text_contents()
        assert cells[square - 1] == "X" and cells.count("O") == 1
        assert "choose_square" in page.text_content("#log li .call")
        assert page.inner_text("#status") in ("Your move.", "The model wins.")


def test_a_busy_port_is_a_clear_error():
    import socket

    from rich.console import Console

    from looprl.apps.play import PlayError
    from looprl.apps.play_web import serve

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(PlayError, match=f"cannot listen on 127.0.0.1:{port}.*try --port"):
            serve(ScriptedModel([]), port=port, console=Console(), human="X", variant="base",
                  temperature=0.0, seed=None)  # fmt: skip
