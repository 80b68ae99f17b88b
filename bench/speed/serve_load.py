"""`looprl serve` under load, side by side with vLLM's OpenAI server on the same model.

    .venv/bin/python bench/speed/serve_load.py [--model smollm2-135m] [--tries 20]
        [--concurrency 32 100] [--max-tokens 64] [--long-tokens 600] [--servers looprl vllm]

Starts `looprl serve MODEL` and `vllm.entrypoints.openai.api_server` from `.venv-vllm`
(on the same saved model folder, float32, eager, 2 GiB of KV cache, hermes tool calls) as
child processes on free local ports and drives each with the official `openai` client,
taking turns (one server works while the other idles) measurement by measurement:

(a) head-of-line blocking: a 600-token reply streams, and once it is decoding a 2-token
    request is sent and timed (then the long one is cancelled); `--tries` times.
(b) throughput: `--concurrency` N chat requests with the tic-tac-toe move tool
    (tool_choice `--tool-choice`, temperature 1, `--max-tokens`) sent at once; the
    completion tokens/s and requests/s over the burst's wall-clock, and the p50/p99
    latency of its requests.

Prints a table (medians and percentiles) and ends with `RESULT looprl_short_p50_s=…
vllm_short_p50_s=… looprl_tok_s_32=… vllm_tok_s_32=… … req_s_ratio_32=… tok_s_ratio_32=…`
(looprl / vLLM). The table also gives each side's completion tokens per reply and the
share of replies that hold a tool call: the servers write a forced call differently
(vLLM as a JSON list, looprl in the model's own call syntax, its fixed parts written by
jump-forward decoding), so requests/s is the like-for-like throughput. Both servers
run on the same CPU, never working at once; on a shared machine only ratios from one run
mean much.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import ROOT, arguments, median, result_line
from looprl.envs.builtin.tictactoe import TicTacToeMove

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


def short_latency(client: openai.OpenAI, model: str, long_tokens: int) -> float:
    """(a), one try: a `long_tokens` reply streams; once its first token is there, a
    2-token request is sent and timed; then the long one is cancelled (stream closed)."""
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": LONG_PROMPT}],
        max_tokens=long_tokens, temperature=1.0, stream=True,
    )  # fmt: skip
    tokens = 0
    for chunk in stream:
        tokens += bool(chunk.choices and chunk.choices[0].delta.content)
        if tokens >= 2:  # past its prefill, decoding
            break
    start_s = time.perf_counter()
    client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": SHORT_PROMPT}], max_tokens=2,
        temperature=0.0,
    )  # fmt: skip
    took = time.perf_counter() - start_s
    stream.close()
    time.sleep(1.0)  # the server drops the cancelled generation
    return took


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

    def one(body: dict) -> tuple[float, int, bool]:
        start_s = time.perf_counter()
        reply = client.chat.completions.create(
            model=model, max_tokens=max_tokens, temperature=1.0, tool_choice=tool_choice, **body
        )
        called = bool(reply.choices[0].message.tool_calls)
        return time.perf_counter() - start_s, reply.usage.completion_tokens, called

    start_s = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, bodies))
    wall = time.perf_counter() - start_s
    latencies = [r[0] for r in results]
    tokens = sum(r[1] for r in results)
    return {
        "tok_s": tokens / wall, "req_s": n / wall, "p50_s": percentile(latencies, 0.5),
        "p99_s": percentile(latencies, 0.99), "tokens": tokens, "wall_s": wall,
        "tok_per_reply": tokens / n, "calls": sum(r[2] for r in results) / n,
    }  # fmt: skip


def measure(clients: dict[str, openai.OpenAI], model: str, args) -> dict[str, dict]:
    """Every measurement on each server in turn (interleaved), so that both see the
    same load of a shared CPU."""
    found: dict[str, dict] = {name: {"short": []} for name in clients}
    for client in clients.values():  # warm-up: first-call costs, grammars, shapes
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": SHORT_PROMPT}], max_tokens=4
        )
        burst(client, model, 8, args.max_tokens, args.tool_choice)
    for _ in range(args.tries):
        for name, client in clients.items():
            found[name]["short"].append(short_latency(client, model, args.long_tokens))
    for name in clients:
        print(f"{name}: 2-token latency p50 {median(found[name]['short']):.2f} s", flush=True)
    for n in args.concurrency:
        for name, client in clients.items():
            found[name][n] = r = burst(client, model, n, args.max_tokens, args.tool_choice)
            print(
                f"{name}: {n} concurrent: {r['tok_s']:.1f} tok/s, {r['req_s']:.2f} req/s, "
                f"p50 {r['p50_s']:.2f} s, p99 {r['p99_s']:.2f} s", flush=True,
            )  # fmt: skip
    return found


def start_servers(args, work: Path) -> dict[str, tuple[subprocess.Popen, int]]:
    """The servers asked for, each a child process on a free port."""
    servers = {}
    if "looprl" in args.servers:
        port = free_port()
        command = [sys.executable, "-m", "looprl.cli", "serve", args.model, "--port", str(port)]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        servers["looprl"] = start(command, env, work / "looprl.log", port), port
    if "vllm" in args.servers:
        folder = Path.home() / ".cache" / "looprl" / args.model
        port = free_port()
        command = [
            str(ROOT / ".venv-vllm" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(folder), "--served-model-name", args.model, "--port", str(port),
            "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "4096",
            "--enforce-eager", "--kv-cache-memory-bytes", str(2 * 2**30),
            # tool_choice "required" needs a parser; hermes is SmolLM2's call syntax
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
        servers["vllm"] = start(command, env, work / "vllm.log", port), port
    return servers


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 100])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=600)
    parser.add_argument("--tool-choice", default="required")
    parser.add_argument(
        "--servers", nargs="+", choices=["looprl", "vllm"], default=["looprl", "vllm"]
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="serve-load-"))
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    try:
        servers = start_servers(args, work)
        clients = {
            name: openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1",
                api_key="none",
                max_retries=0,
                timeout=1800,
            )  # fmt: skip
            for name, (_, port) in servers.items()
        }
        results = measure(clients, args.model, args)
    finally:
        for child, _ in servers.values():
            stop(child)

    print(f"\n{args.model}, CPU ({os.cpu_count()} cores), measurements interleaved:")
    print(f"{'':32}" + "".join(f"{name:>12}" for name in results))
    print(
        f"{'2-token p50 (s)':32}" + "".join(f"{median(r['short']):12.2f}" for r in results.values())
    )
    for n in args.concurrency:
        for key, label in [("tok_s", "tok/s"), ("req_s", "req/s"), ("p50_s", "p50 (s)"),
                           ("p99_s", "p99 (s)"), ("tok_per_reply", "tokens/reply"),
                           ("calls", "share with a call")]:  # fmt: skip
            row = f"{n} concurrent {label}"
            print(f"{row:32}" + "".join(f"{r[n][key]:12.2f}" for r in results.values()))
    fields = {f"{name}_short_p50_s": f"{median(r['short']):.2f}" for name, r in results.items()}
    for n in args.concurrency:
        for name, r in results.items():
            fields[f"{name}_tok_s_{n}"] = f"{r[n]['tok_s']:.1f}"
            fields[f"{name}_req_s_{n}"] = f"{r[n]['req_s']:.2f}"
            fields[f"{name}_p50_s_{n}"] = f"{r[n]['p50_s']:.2f}"
            fields[f"{name}_p99_s_{n}"] = f"{r[n]['p99_s']:.2f}"
        if len(results) == 2:
            for key in ("req_s", "tok_s"):
                ratio = results["looprl"][n][key] / results["vllm"][n][key]
                fields[f"{key}_ratio_{n}"] = f"{ratio:.2f}"
    print(result_line(fields))


if __name__ == "__main__":
    main()
