"""The work `looprl serve` does for a client that has gone: CPU-seconds after a dropped
non-streaming request.

    .venv/bin/python bench/speed/serve_cancel.py [--model smollm2-135m] [--max-tokens 2000]
        [--timeout-s 1] [--window-s 10] [--endpoints chat completions responses]

Starts `looprl serve MODEL` as a child process on a free local port. Per endpoint, a
non-streaming request asks for `--max-tokens` tokens through the official `openai`
client with a `--timeout-s` timeout, so the client gives up and closes its connection
while the server generates. The server's CPU-seconds (user + system, from the kernel)
are then sampled over the `--window-s` seconds after the drop, with the decode steps
that its `GET /health` counts; an idle server uses next to nothing, a server that goes
on generating for nobody uses about a core. The same is measured with the server idle
first, for scale. Ends with `RESULT idle_cpu_s=… chat_cpu_s=… chat_steps=… …`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import ROOT, arguments, print_result

PROMPT = "Write a very long story about a robot who learns to play tic-tac-toe."
SPECIAL_TOKENS = (0, 1, 2)  # SmolLM2's <|endoftext|>, <|im_start|>, <|im_end|>


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def health(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/health", timeout=30) as response:
        return json.loads(response.read())


def start(model: str, port: int, log: Path) -> subprocess.Popen:
    """`looprl serve MODEL` in a child process, once its `GET /health` answers."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "looprl", "serve", model, "--port", str(port)]
    with open(log, "wb") as sink:
        child = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 600
    while time.time() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"looprl serve exited ({child.returncode}); see {log}")
        try:
            health(f"http://127.0.0.1:{port}")
            return child
        except OSError:
            time.sleep(0.5)
    child.kill()
    raise RuntimeError(f"looprl serve did not start within 10 min; see {log}")


def cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def drop(client: openai.OpenAI, model: str, endpoint: str, max_tokens: int) -> None:
    """One non-streaming request the client gives up on (its timeout). Chat and
    completions requests keep the model from ending early (its special tokens biased
    away); a Responses request has no `logit_bias`, and a story is long anyway."""
    no_end = {str(token): -100.0 for token in SPECIAL_TOKENS}
    try:
        if endpoint == "chat":
            messages = [{"role": "user", "content": PROMPT}]
            client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, logit_bias=no_end
            )
        elif endpoint == "completions":
            client.completions.create(
                model=model, prompt=PROMPT, max_tokens=max_tokens, logit_bias=no_end
            )
        else:
            client.responses.create(model=model, input=PROMPT, max_output_tokens=max_tokens)
    except openai.APITimeoutError:
        return
    raise RuntimeError(f"the {endpoint} request finished before the client's timeout")


def window(process: psutil.Process, base: str, seconds: float) -> tuple[float, int | None]:
    """CPU-seconds the server uses over the next `seconds`, and its decode steps then
    (None for a server whose /health does not count them)."""
    cpu0, steps0 = cpu_s(process), health(base).get("decode_steps")
    time.sleep(seconds)
    cpu1, steps1 = cpu_s(process), health(base).get("decode_steps")
    return cpu1 - cpu0, None if steps0 is None else steps1 - steps0


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--timeout-s", type=float, default=1.0)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--endpoints", nargs="+", default=["chat", "completions", "responses"])
    args = parser.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="serve_cancel_")) / "server.log"
    child = start(args.model, port, log)
    try:
        process = psutil.Process(child.pid)
        model = health(base)["model"]
        client = openai.OpenAI(
            base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=args.timeout_s
        )
        fields: dict[str, object] = {}
        idle, _ = window(process, base, args.window_s)
        fields["idle_cpu_s"] = round(idle, 2)
        print(f"{'idle':<12} {idle:6.2f} CPU-s over {args.window_s:g} s", flush=True)
        for endpoint in args.endpoints:
            drop(client, model, endpoint, args.max_tokens)
            used, steps = window(process, base, args.window_s)
            print(
                f"{endpoint:<12} {used:6.2f} CPU-s, {steps} decode steps over the "
                f"{args.window_s:g} s after the client left",
                flush=True,
            )
            fields[f"{endpoint}_cpu_s"] = round(used, 2)
            fields[f"{endpoint}_steps"] = steps
            deadline = time.time() + 600  # let a generation nobody stopped end first
            while health(base).get("live_rows", 0) and time.time() < deadline:
                time.sleep(0.5)
    finally:
        child.terminate()  # uvicorn waits for the requests it still runs: a short grace
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    print_result(fields)


if __name__ == "__main__":
    main()
