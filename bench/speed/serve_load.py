"""`looprl serve` under load, side by side with vLLM's OpenAI server on the same model.

    .venv/bin/python bench/speed/serve_load.py [--model smollm2-135m] [--tries 20]
        [--concurrency 32 100] [--max-tokens 64] [--long-tokens 600] [--no-vllm]

Starts `looprl serve MODEL` (and, unless --no-vllm, `vllm.entrypoints.openai.api_server`
from `.venv-vllm` on the same saved model folder, float32, eager, 2 GiB of KV cache) as
child processes on free local ports, one after the other, and drives each with the
official `openai` client:

(a) head-of-line blocking: a 600-token generation runs (restarted whenever it ends)
    while 2-token requests are sent one at a time; latency of each of `--tries`.
(b) throughput: `--concurrency` N chat requests with the tic-tac-toe move tool
    (tool_choice `--tool-choice`, temperature 1, `--max-tokens`) sent at once; the
    completion tokens/s and requests/s over the burst's wall-clock, and the p50/p99
    latency of its requests.

Prints a table (medians and percentiles) and ends with `RESULT short_p50_s=…
looprl_tok_s_32=… vllm_tok_s_32=… …`. Both servers run on the same CPU one after the
other, never at once; on a shared machine only ratios from one run mean much.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import ROOT, arguments, median, result_line
from looprl.envs.tictactoe import TicTacToeMove

LONG_PROMPT = "Write a very long story about a robot who learns to play tic-tac-toe."
SHORT_PROMPT = "Say hi."


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(command: list[str], env: dict[str, str], log: Path, port: int) -> subprocess.Popen:
    """Start a server child and wait (up to 15 min) until GET /health answers 200."""
    with open(log, "wb") as sink:
        child = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 900
    while time.time() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"{command[0]} exited ({child.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return child
        except OSError:
            pass
        time.sleep(1.0)
    child.kill()
    raise RuntimeError(f"{command[0]} did not start within 15 min; see {log}")


def stop(child: subprocess.Popen) -> None:
    child.terminate()
    try:
        child.wait(timeout=60)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def short_latencies(client: openai.OpenAI, model: str, tries: int, long_tokens: int) -> list[float]:
    """(a): 2-token requests, one at a time, while a long generation runs throughout."""
    running = threading.Event()
    stopping = threading.Event()

    def keep_long() -> None:
        while not stopping.is_set():
            running.set()
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": LONG_PROMPT}],
                max_tokens=long_tokens, temperature=1.0,
            )  # fmt: skip

    thread = threading.Thread(target=keep_long, daemon=True)
    thread.start()
    running.wait()
    time.sleep(2.0)  # the long one is past its prefill and decoding
    out = []
    for _ in range(tries):
        start_s = time.perf_counter()
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": SHORT_PROMPT}], max_tokens=2,
            temperature=0.0,
        )  # fmt: skip
        out.append(time.perf_counter() - start_s)
        time.sleep(0.2)
    stopping.set()
    thread.join()
    return out


def tool_requests(n: int) -> list[dict]:
    """n chat requests for one tic-tac-toe move each (cycling over 50 positions)."""
    env = TicTacToeMove()
    tasks = env.tasks("eval", n=50)
    bodies = []
    for i in range(n):
        obs = env.reset(tasks[i % len(tasks)])
        messages = [m.to_dict() for m in obs.messages]
        bodies.append({"messages": messages, "tools": obs.tools})
    return bodies


def burst(
    client: openai.OpenAI, model: str, n: int, max_tokens: int, tool_choice: str
) -> dict[str, float]:
    """(b): n tool-call requests at once; throughput and latency percentiles."""
    bodies = tool_requests(n)

    def one(body: dict) -> tuple[float, int]:
        start_s = time.perf_counter()
        reply = client.chat.completions.create(
            model=model, max_tokens=max_tokens, temperature=1.0, tool_choice=tool_choice, **body
        )
        return time.perf_counter() - start_s, reply.usage.completion_tokens

    start_s = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, bodies))
    wall = time.perf_counter() - start_s
    latencies = [r[0] for r in results]
    tokens = sum(r[1] for r in results)
    return {
        "tok_s": tokens / wall, "req_s": n / wall, "p50_s": percentile(latencies, 0.5),
        "p99_s": percentile(latencies, 0.99), "tokens": tokens, "wall_s": wall,
    }  # fmt: skip


def measure(name: str, url: str, model: str, args) -> dict:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=1800)
    client.chat.completions.create(  # warm-up
        model=model, messages=[{"role": "user", "content": SHORT_PROMPT}], max_tokens=4
    )
    found: dict = {"short": short_latencies(client, model, args.tries, args.long_tokens)}
    print(f"{name}: 2-token latency p50 {median(found['short']):.2f} s", flush=True)
    burst(client, model, 8, args.max_tokens, args.tool_choice)  # warm-up: grammars, shapes
    for n in args.concurrency:
        found[n] = burst(client, model, n, args.max_tokens, args.tool_choice)
        r = found[n]
        print(
            f"{name}: {n} concurrent: {r['tok_s']:.1f} tok/s, {r['req_s']:.2f} req/s, "
            f"p50 {r['p50_s']:.2f} s, p99 {r['p99_s']:.2f} s", flush=True,
        )  # fmt: skip
    return found


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 100])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=600)
    parser.add_argument("--tool-choice", default="required")
    parser.add_argument("--no-vllm", action="store_true")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="serve-load-"))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    results = {}
    port = free_port()
    command = [sys.executable, "-m", "looprl.cli", "serve", args.model, "--port", str(port)]
    child = start(command, env, work / "looprl.log", port)
    try:
        results["looprl"] = measure("looprl", f"http://127.0.0.1:{port}", args.model, args)
    finally:
        stop(child)
    if not args.no_vllm:
        folder = Path.home() / ".cache" / "looprl" / args.model
        port = free_port()
        command = [
            str(ROOT / ".venv-vllm" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(folder), "--served-model-name", args.model, "--port", str(port),
            "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "4096",
            "--enforce-eager", "--kv-cache-memory-bytes", str(2 * 2**30),
        ]  # fmt: skip
        vllm_env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
        child = start(command, vllm_env, work / "vllm.log", port)
        try:
            results["vllm"] = measure("vllm", f"http://127.0.0.1:{port}", args.model, args)
        finally:
            stop(child)

    print(f"\n{args.model}, CPU ({os.cpu_count()} cores), servers one after the other:")
    print(f"{'':24}" + "".join(f"{name:>12}" for name in results))
    print(
        f"{'2-token p50 (s)':24}" + "".join(f"{median(r['short']):12.2f}" for r in results.values())
    )
    for n in args.concurrency:
        for key, label in [("tok_s", "tok/s"), ("req_s", "req/s"), ("p50_s", "p50 (s)"),
                           ("p99_s", "p99 (s)")]:  # fmt: skip
            row = f"{n} concurrent {label}"
            print(f"{row:24}" + "".join(f"{r[n][key]:12.2f}" for r in results.values()))
    fields = {"short_p50_s": f"{median(results['looprl']['short']):.2f}"}
    if "vllm" in results:
        fields["vllm_short_p50_s"] = f"{median(results['vllm']['short']):.2f}"
    for n in args.concurrency:
        for name, r in results.items():
            fields[f"{name}_tok_s_{n}"] = f"{r[n]['tok_s']:.1f}"
            fields[f"{name}_req_s_{n}"] = f"{r[n]['req_s']:.2f}"
            fields[f"{name}_p50_s_{n}"] = f"{r[n]['p50_s']:.2f}"
            fields[f"{name}_p99_s_{n}"] = f"{r[n]['p99_s']:.2f}"
        if "vllm" in results:
            ratio = results["looprl"][n]["tok_s"] / results["vllm"][n]["tok_s"]
            fields[f"tok_s_ratio_{n}"] = f"{ratio:.2f}"
    print(result_line(fields))


if __name__ == "__main__":
    main()
