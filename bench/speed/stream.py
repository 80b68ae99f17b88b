"""Streaming latency over HTTP: time to the first content token vs the whole reply.

    .venv/bin/python bench/speed/stream.py [--model smollm2-135m] [--max-tokens 128] [--repeats 5]
                                     [--device cpu|cuda]

Starts `looprl serve`'s app on 127.0.0.1 (a free port) and asks it, with the official
`openai` client, for the same chat reply (seeded, temperature 0.7, `max_tokens` new
tokens) twice per repeat: streamed, timing the first chunk with content and the last
chunk; and not streamed, timing the whole reply. Prints the median of the repeats and
ends with `RESULT stream_first_token_ms=… whole_reply_ms=… stream_total_ms=…
reply_tokens=…`. Streaming pays off when `stream_first_token_ms` is a small part of
`whole_reply_ms`; the two totals should be close (streaming costs little).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import openai

from looprl.apps.loading import load_chat_model
from looprl.apps.serve import create_app, serving

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import arguments, median, result_line

PROMPT = "Write a short story about a robot who learns to play tic-tac-toe."


def timed_stream(client: openai.OpenAI, model: str, max_tokens: int, seed: int):
    """(ms to the first content chunk, ms to the end of the stream, content)."""
    start = time.perf_counter()
    first, content = None, ""
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens,
        temperature=0.7, seed=seed, stream=True,
    )  # fmt: skip
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                content += choice.delta.content
    end = time.perf_counter()
    return 1000 * ((first or end) - start), 1000 * (end - start), content


def timed_whole(client: openai.OpenAI, model: str, max_tokens: int, seed: int):
    """(ms to the whole reply, completion tokens, content)."""
    start = time.perf_counter()
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens,
        temperature=0.7, seed=seed,
    )  # fmt: skip
    end = time.perf_counter()
    return 1000 * (end - start), reply.usage.completion_tokens, reply.choices[0].message.content


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    chat_model = load_chat_model(args.model, device=args.device)
    rows = []
    with serving(create_app(chat_model)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        timed_whole(client, chat_model.name, 8, 0)  # warm-up: first-call costs out of the way
        for repeat in range(args.repeats):
            first_ms, stream_ms, streamed = timed_stream(
                client, chat_model.name, args.max_tokens, repeat
            )
            whole_ms, tokens, whole = timed_whole(client, chat_model.name, args.max_tokens, repeat)
            same = "same" if streamed == whole else "DIFFERENT"
            rows.append((first_ms, stream_ms, whole_ms, tokens))
            print(
                f"repeat {repeat}: first token {first_ms:7.0f} ms, stream end {stream_ms:7.0f} ms, "
                f"whole reply {whole_ms:7.0f} ms, {tokens} tokens, streamed text {same}"
            )
    first, total, whole, tokens = (median(column) for column in zip(*rows))
    print(f"{args.model} on {args.device}, median of {args.repeats}:")
    print(f"  first content token  {first:8.0f} ms")
    print(f"  streamed reply       {total:8.0f} ms")
    print(f"  whole reply          {whole:8.0f} ms  ({tokens:.0f} tokens)")
    print(result_line({
        "stream_first_token_ms": f"{first:.0f}", "whole_reply_ms": f"{whole:.0f}",
        "stream_total_ms": f"{total:.0f}", "reply_tokens": f"{tokens:.0f}",
    }))  # fmt: skip


if __name__ == "__main__":
    main()
