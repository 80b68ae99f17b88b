"""Rollout throughput: looprl's hf engine vs transformers `generate`, side by side.

    .venv/bin/python bench/rollout.py [--model smollm2-135m] [--batches 8,32,64] [--repeats 3]

Same model, same tic-tac-toe prompts (distinct boards, so prefix sharing does not apply),
64 new tokens, temperature 1, no grammar (so jump-forward does not apply either): this
measures the plain decoding loop. Prints a table of generated tokens/s (median of the
repeats) and ends with `RESULT rollout_speedup_bN=...` lines' worth of fields.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from looprl.chat import ChatRenderer
from looprl.engine import GenerationRequest, SamplingParams
from looprl.engine.hf import HFEngine
from looprl.envs.tictactoe import TicTacToeMove
from looprl.models import load_causal_lm, load_tokenizer

NEW_TOKENS = 64


def prompts(renderer: ChatRenderer, n: int) -> list[list[int]]:
    env = TicTacToeMove(tool_choice="auto")
    out = []
    for task in env.tasks("train", n=n, seed=7):
        obs = env.reset(task)
        out.append(renderer.prompt_ids(obs.messages, obs.tools))
    return out


def run_looprl(engine: HFEngine, batch: list[list[int]], seed: int) -> tuple[int, float]:
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=seed)
    start = time.perf_counter()
    outs = engine.generate([GenerationRequest(p) for p in batch], params)
    return sum(len(o.ids) for o in outs), time.perf_counter() - start


@torch.inference_mode()
def run_generate(model, tokenizer, batch: list[list[int]], seed: int) -> tuple[int, float]:
    longest = max(len(p) for p in batch)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch])
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
        top_k=0, max_new_tokens=NEW_TOKENS, pad_token_id=pad,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )  # fmt: skip
    seconds = time.perf_counter() - start
    new = out[:, longest:]
    # tokens produced before (and including) each row's EOS
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    produced = 0
    for row in new.tolist():
        produced += row.index(eos) + 1 if eos in row else len(row)
    return produced, seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", default="8,32,64")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    model = load_causal_lm(args.model, torch.float32).eval()
    renderer = ChatRenderer(tokenizer, model_name=args.model)
    engine = HFEngine(model, tokenizer, renderer.eos_ids, batch_size=256)
    sizes = [int(b) for b in args.batches.split(",")]
    pool = prompts(renderer, max(sizes))
    run_looprl(engine, pool[:2], 0)  # warm-up
    run_generate(model, tokenizer, pool[:2], 0)
    print(f"{'batch':>5} {'looprl tok/s':>13} {'generate tok/s':>15} {'ratio':>6}")
    result = {}
    for size in sizes:
        batch = pool[:size]
        ours, theirs = [], []
        for r in range(args.repeats):
            n, s = run_looprl(engine, batch, r)
            ours.append(n / s)
            n, s = run_generate(model, tokenizer, batch, r)
            theirs.append(n / s)
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"{size:>5} {a:>13.1f} {b:>15.1f} {a / b:>6.2f}")
        result[f"rollout_speedup_b{size}"] = f"{a / b:.2f}"
        result[f"looprl_tok_s_b{size}"] = f"{a:.1f}"
        result[f"generate_tok_s_b{size}"] = f"{b:.1f}"
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
