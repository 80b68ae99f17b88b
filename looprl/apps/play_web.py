"""`looprl play --web`: the game of `looprl.apps.play` in a small local web page.

A stdlib HTTP server on 127.0.0.1 serves one self-contained page (inline CSS and JS, no
external assets) and three JSON endpoints; games are `PlaySession`s kept in memory and
keyed by a random id:

    GET  /api/info                       -> {model, variants, variant, human}
    POST /api/new  {human, variant}      -> {id, board, status, message, turns, ...}
    POST /api/move {id, square}          -> the same, after your move and the model's answer

An error answers {"error": "..."} with status 400 (a refused move, bad JSON) or 404 (an
unknown game). The server only answers requests addressed to it by its own host name and
POSTs sent as JSON, so other web sites cannot drive the model through your browser.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections import OrderedDict
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from looprl.apps.play import PlayError, PlaySession

if TYPE_CHECKING:
    from rich.console import Console

    from looprl.apps.inference import ChatModel

MAX_GAMES = 256  # the oldest games are forgotten beyond this


class PlayServer(ThreadingHTTPServer):
    """The HTTP server plus the model and the games in progress."""

    daemon_threads = True

    def __init__(self, model: ChatModel, port: int, **defaults: Any) -> None:
        super().__init__(("127.0.0.1", port), PlayHandler)
        self.model = model
        self.defaults = defaults  # human, variant, temperature, seed
        self.games: OrderedDict[str, tuple[PlaySession, threading.Lock]] = OrderedDict()
        self.games_lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/"

    def info(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "variants": list(self.model.variants),
            "variant": self.defaults["variant"],
            "human": self.defaults["human"],
        }

    def new_game(self, body: dict[str, Any]) -> dict[str, Any]:
        session = PlaySession(
            self.model,
            human=str(body.get("human") or self.defaults["human"]),
            variant=body.get("variant") or self.defaults["variant"],
            temperature=self.defaults["temperature"],
            seed=self.defaults["seed"],
        )
        if session.status == "model_to_move":
            session.model_move()
        game_id = secrets.token_hex(8)
        with self.games_lock:
            self.games[game_id] = (session, threading.Lock())
            while len(self.games) > MAX_GAMES:
                self.games.popitem(last=False)
        return {"id": game_id, **session.to_dict()}

    def move(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.games_lock:
            game = self.games.get(str(body.get("id")))
        if game is None:
            raise LookupError("no such game (the server may have restarted): start a new game")
        session, lock = game
        with lock:  # one move at a time per game; other games go on in parallel
            turn = session.human_move(body.get("square"))
        return {"id": body["id"], "model_call": turn and turn.text, **session.to_dict()}


class PlayHandler(BaseHTTPRequestHandler):
    server: PlayServer

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        if not self._host_ok():
            return
        if self.path in ("/", "/index.html"):
            self._send(HTTPStatus.OK, PAGE.encode(), "text/html; charset=utf-8")
        elif self.path == "/api/info":
            self._json(HTTPStatus.OK, self.server.info())
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no page {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        if not self._host_ok():
            return
        routes = {"/api/new": self.server.new_game, "/api/move": self.server.move}
        if self.path not in routes:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no endpoint {self.path}"})
            return
        if self.headers.get("Content-Type", "").split(";")[0].strip() != "application/json":
            self._json(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, {"error": "send application/json"})
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("expected a JSON object")
            self._json(HTTPStatus.OK, routes[self.path](body))
        except LookupError as err:
            self._json(HTTPStatus.NOT_FOUND, {"error": str(err)})
        except (PlayError, ValueError) as err:
            self._json(HTTPStatus.BAD_REQUEST, {"error": str(err)})

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # no access log in the terminal

    def _host_ok(self) -> bool:
        """Refuse requests for another host name (DNS rebinding)."""
        port = self.server.server_address[1]
        if self.headers.get("Host") in (f"127.0.0.1:{port}", f"localhost:{port}"):
            return True
        self._json(HTTPStatus.FORBIDDEN, {"error": "wrong Host header"})
        return False

    def _json(self, status: HTTPStatus, data: dict[str, Any]) -> None:
        self._send(status, json.dumps(data).encode(), "application/json")

    def _send(self, status: HTTPStatus, payload: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-store")
        if content_type.startswith("text/html"):
            self.send_header("Content-Security-Policy", CSP)
        self.end_headers()
        self.wfile.write(payload)


def serve(model: ChatModel, *, port: int, console: Console, **defaults: Any) -> None:
    """Serve the page until Ctrl-C."""
    try:
        server = PlayServer(model, port, **defaults)
    except OSError as err:
        raise PlayError(f"cannot listen on 127.0.0.1:{port} ({err.strerror}); try --port") from None
    console.print(f"playing {model.name} at [bold]{server.url}[/] (Ctrl-C to stop)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        console.print("stopped")
    finally:
        server.server_close()


# ------------------------------------------------------------------------- the page

CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'"
)

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>looprl play</title>
<style>
body { font: 16px system-ui, sans-serif; max-width: 40rem; margin: 2rem auto; padding: 0 1rem;
       color: #222; }
h1 { font-size: 1.3rem; } .controls { display: flex; gap: 1rem; flex-wrap: wrap;
       align-items: center; margin-bottom: 1rem; }
#board { display: grid; grid-template-columns: repeat(3, 5rem); gap: 4px; }
#board button { width: 5rem; height: 5rem; font-size: 2.2rem; font-weight: bold;
       border: 1px solid #999; background: #fafafa; cursor: pointer; }
#board button:disabled { cursor: default; } #board button.empty { color: #bbb; font-size: 1rem; }
.X { color: #0a7ea4; } .O { color: #b0308f; }
#status { font-weight: bold; margin: 1rem 0; min-height: 1.4em; } .error { color: #b00020; }
#log { list-style: none; padding: 0; } #log li { border-left: 3px solid #ccc; margin: .5rem 0;
       padding-left: .6rem; } #log pre { margin: .2rem 0; white-space: pre-wrap;
       background: #f3f3f3; padding: .3rem; } .illegal { border-color: #b00020 !important; }
</style></head>
<body>
<h1>tic-tac-toe against <span id="model">the model</span></h1>
<div class="controls">
  <label>you play <select id="human"><option>X</option><option>O</option></select></label>
  <label id="variant-switch" hidden>model
    <select id="variant"></select></label>
  <button id="new">new game</button>
</div>
<div id="board"></div>
<div id="status"></div>
<h2>the model's tool calls</h2>
<ol id="log"></ol>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
let game = null, busy = false;

async function api(path, body) {
  const res = await fetch(path, body === undefined ? {} : {
    method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
  const data = await res.json();
  if (!res.ok) throw new Error(data.error || res.statusText);
  return data;
}

function show(state) {
  game = state;
  const board = $("board");
  board.replaceChildren();
  [...state.board].forEach((mark, i) => {
    const cell = document.createElement("button");
    cell.dataset.square = i + 1;
    cell.className = mark === "." ? "empty" : mark;
    cell.textContent = mark === "." ? String(i + 1) : mark;
    cell.disabled = busy || mark !== "." || state.status !== "human_to_move";
    cell.addEventListener("click", () => move(i + 1));
    board.append(cell);
  });
  $("status").className = "";
  $("status").textContent = state.message;
  $("log").replaceChildren(...state.turns.map((turn) => {
    const item = document.createElement("li");
    if (!turn.legal) item.className = "illegal";
    const head = document.createElement("div");
    head.textContent = `model (${turn.mark}, ${turn.variant}): ` + (turn.legal
      ? `plays ${turn.square}` : `illegal move (${turn.reason}), forfeits`);
    const text = document.createElement("pre");
    text.className = "call";
    text.textContent = turn.text.trim() || "(empty completion)";
    item.append(head, text);
    return item;
  }));
}

function fail(err) {
  $("status").className = "error";
  $("status").textContent = err.message;
}

async function run(action) {
  busy = true;
  if (game) show(game);
  $("status").textContent = "The model is thinking.";
  try { show(await action()); } catch (err) { busy = false; if (game) show(game); fail(err); }
  busy = false;
  if (game) show(game);
}

const newGame = () => run(() => api("/api/new", {human: $("human").value,
                                                 variant: $("variant").value || null}));
const move = (square) => run(() => api("/api/move", {id: game.id, square}));

async function start() {
  try {
    const info = await api("/api/info");
    $("model").textContent = info.model;
    $("human").value = info.human;
    $("variant").replaceChildren(...info.variants.map((v) => new Option(v, v)));
    $("variant").value = info.variant;
    $("variant-switch").hidden = info.variants.length < 2;
  } catch (err) { fail(err); return; }
  $("new").addEventListener("click", newGame);
  $("human").addEventListener("change", newGame);
  $("variant").addEventListener("change", newGame);
  await newGame();
}
start();
</script>
</body></html>
"""
