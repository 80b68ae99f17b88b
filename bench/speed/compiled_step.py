"""The hf engine's decode step eager against compiled (`rollout.compile`), side by side.

    .venv/bin/python bench/speed/compiled_step.py [--model smollm2-135m] [--batches 8,32]
                                                  [--repeats 3] [--device cpu|cuda]

bench/speed/rollout.py's workload (tic-tac-toe prompts that share their system prompt,
64 new tokens, temperature 1, float32) through three engines and `generate`:

- `eager`: the engine as it ships (cascade attention: the shared head kept once);
- `eager, no cascade`: the head copied into every row, the layout the compiled step
  needs (engine/compiled_step.py: a batch with a cascade prefix decodes eagerly);
- `compiled`: that layout with `compile_step="on"` (inductor on the CPU, CUDA graphs on
  a GPU). Its first call at each batch size compiles the graphs it meets; that call is
  timed apart (`compile s`, with the graphs it compiled) and not counted in tokens/s.

Prints tokens/s (median of the repeats, the engines interleaved in each repeat), each
engine's tokens/s against `generate`, and the floor of rollout.py (the decode step's
matrix products + prefill; `of floor` = tokens/s over it). Ends with a `RESULT` line:
`engine_vs_generate_bN`, `engine_compiled_vs_generate_bN`, `compiled_vs_eager_bN`,
`compile_s_bN`, `eager_of_floor_bN`, `compiled_of_floor_bN`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from looprl.chat import ChatRenderer
from looprl.engine.hf import HFEngine
from looprl.model.load import load_causal_lm, load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import arguments, median, result_line
from bench.speed.rollout import (
    matmul_floor,
    prefill_seconds,
    prompts,
    run_generate,
    run_looprl,
)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    tokenizer = load_tokenizer(args.model)
    renderer = ChatRenderer(tokenizer, model_name=args.model)

    def model():
        return load_causal_lm(args.model, torch.float32).to(device).eval()

    reference = model()  # `generate`'s own copy: the engines switch their attention
    sizes = [int(b) for b in args.batches.split(",")]
    engines = {
        "eager": HFEngine(model(), tokenizer, renderer.eos_ids, batch_size=256),
        "eager, no cascade": HFEngine(
            model(), tokenizer, renderer.eos_ids, batch_size=256, cascade_attention=False
        ),
        "compiled": HFEngine(
            model(),
            tokenizer,
            renderer.eos_ids,
            batch_size=256,
            cascade_attention=False,
            compile_step="on",
        ),
    }
    pool = prompts(renderer, max(sizes))
    for name, engine in engines.items():
        if name != "compiled":  # the compiled one's first calls are timed below
            run_looprl(engine, pool[:2], 0)
    run_generate(reference, tokenizer, pool[:2], 0)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{where}, {torch.get_num_threads()} threads; tokens/s, median of {args.repeats}")
    result = {}
    compiled = engines["compiled"]
    for size in sizes:
        batch = pool[:size]
        before, shapes = compiled.compiled.compile_seconds, compiled.compiled.shapes
        start = time.perf_counter()
        run_looprl(compiled, batch, 0)  # compiles this batch size's graphs
        first = time.perf_counter() - start
        compile_s = compiled.compiled.compile_seconds - before
        speeds: dict[str, list[float]] = {name: [] for name in [*engines, "generate"]}
        produced = []
        for r in range(args.repeats):
            for name, engine in engines.items():
                n, s = run_looprl(engine, batch, r)
                speeds[name].append(n / s)
                produced.append(n)
            n, s = run_generate(reference, tokenizer, batch, r)
            speeds["generate"].append(n / s)
        tok_s = {name: median(values) for name, values in speeds.items()}
        floor = floor_tok_s(engines["eager"], batch, median(produced))
        print(
            f"batch {size}: compile {compile_s:.1f} s ({compiled.compiled.shapes - shapes} "
            f"shapes; the first compiled generate took {first:.1f} s); floor {floor:.1f} tok/s"
        )
        print(f"  {'engine':<18} {'tok/s':>8} {'vs generate':>12} {'of floor':>9}")
        for name, value in tok_s.items():
            ratio = value / tok_s["generate"]
            print(f"  {name:<18} {value:>8.1f} {ratio:>12.2f} {value / floor:>9.2f}")
        result[f"engine_vs_generate_b{size}"] = f"{tok_s['eager'] / tok_s['generate']:.2f}"
        result[f"engine_compiled_vs_generate_b{size}"] = (
            f"{tok_s['compiled'] / tok_s['generate']:.2f}"
        )
        result[f"compiled_vs_eager_b{size}"] = f"{tok_s['compiled'] / tok_s['eager']:.2f}"
        result[f"compile_s_b{size}"] = f"{compile_s:.1f}"
        result[f"eager_of_floor_b{size}"] = f"{tok_s['eager'] / floor:.2f}"
        result[f"compiled_of_floor_b{size}"] = f"{tok_s['compiled'] / floor:.2f}"
    print(result_line(result))


def floor_tok_s(engine: HFEngine, batch: list[list[int]], tokens: float) -> float:
    """rollout.py's floor: the decode steps' matrix products (the fastest form) plus the
    measured prefill, for `tokens` generated by `len(batch)` rows."""
    plain, first, packed = matmul_floor(engine.model, len(batch))
    steps = tokens / len(batch) - 1  # decode steps of an average row (the first: prefill)
    return tokens / (prefill_seconds(engine, batch) + steps * min(plain, first, packed))


if __name__ == "__main__":
    main()
