"""Decoding's matrix products: the BLAS in PyTorch's CPU wheel against a hand-written kernel.

    .venv/bin/python bench/speed/gemm_probe.py [--model smollm2-135m] [--rows 8,32,64] [--repeats 5]

One decode step's products at a few rows (every linear layer and the output projection,
with the model's own float32 weights, random activations, one row per sequence), timed
four ways, interleaved in each repeat: `F.linear` (x @ W^T), weight-first W @ x^T (see
looprl.forward.fast_linear), and `bench/gemm_probe.cpp`, an AVX-512 float32 kernel
built here with g++, without and with software prefetch of the weights. A second table
times the same products on one layer's weights, reused (in cache), which bounds what any
kernel can do once the weights are no longer read from memory. The hand-written kernel
is a probe, not part of looprl: it answers whether the engine's floor in
`bench/speed/rollout.py` (the faster BLAS form) is the BLAS's or the machine's. Ends with
`RESULT custom_vs_blas_bN=` (fastest BLAS form's ms / fastest custom ms; > 1 means
the custom kernel is faster).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from looprl.model.load import load_causal_lm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import arguments, median, result_line

SOURCE = Path(__file__).with_name("gemm_probe.cpp")
PREFETCH = 4  # weight blocks ahead


def build(out_dir: str) -> ctypes.CDLL | None:
    compiler = shutil.which("g++")
    if compiler is None:
        print("no g++ on PATH: the hand-written kernel is skipped")
        return None
    lib = Path(out_dir) / "gemm_probe.so"
    cmd = [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(SOURCE)]
    subprocess.run(cmd + ["-o", str(lib)], check=True)
    so = ctypes.CDLL(str(lib))
    so.linear_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5
    return so


def custom(so: ctypes.CDLL, prefetch: int):
    threads = torch.get_num_threads()

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], w.shape[0])
        so.linear_f32(
            x.data_ptr(), w.data_ptr(), y.data_ptr(), *x.shape[:1], *w.shape, threads, prefetch
        )
        return y

    return run


def forms(so: ctypes.CDLL | None) -> dict:
    out = {
        "F.linear": lambda x, w: torch.nn.functional.linear(x, w),
        "W@x^T": lambda x, w: (w @ x.T).T,
    }
    if so is not None:
        out["custom"] = custom(so, 0)
        out["custom+prefetch"] = custom(so, PREFETCH)
    return out


def time_step(ways: dict, weights: list, inputs: list, repeats: int) -> dict[str, float]:
    """Median seconds of one pass over all (weight, input) pairs, per way, interleaved."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, fn in ways.items():
            start = time.perf_counter()
            for w, x in zip(weights, inputs):
                fn(x, w)
            times[name].append(time.perf_counter() - start)
    return {name: median(t) for name, t in times.items()}


@torch.inference_mode()
def main() -> None:
    ap = arguments(__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default="8,32,64")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load_causal_lm(args.model, dtype=torch.float32).eval()
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    layer = [
        m.weight.detach() for m in model.model.layers[0].modules() if isinstance(m, torch.nn.Linear)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        ways = forms(build(tmp))
        params = sum(w.numel() for w in weights)
        print(
            f"{torch.get_num_threads()} threads; {len(weights)} weight matrices, "
            f"{params / 1e6:.1f} M float32 weights ({4 * params / 1e6:.0f} MB) per step"
        )
        head = "".join(f"{name:>18}" for name in ways)
        result: dict[str, str] = {}
        for title, mats in (
            ("model weights (from memory)", weights),
            ("one layer's weights, reused (in cache)", layer * 8),
        ):
            print(f"\n{title}: ms per pass over the matrices (GFLOP/s)")
            print(f"{'rows':>4}{head}   max |rel err| custom")
            for rows in (int(r) for r in args.rows.split(",")):
                inputs = [torch.randn(rows, w.shape[1]) for w in mats]
                err = 0.0
                if "custom" in ways:
                    for w, x in zip(mats[:16], inputs[:16]):
                        ref = torch.nn.functional.linear(x, w)
                        got = ways["custom+prefetch"](x, w)
                        err = max(err, ((got - ref).abs().max() / ref.abs().max()).item())
                took = time_step(ways, mats, inputs, args.repeats)
                flops = sum(2 * rows * w.numel() for w in mats)
                cells = "".join(
                    f"{1e3 * t:>8.1f} ({flops / t / 1e9:>5.0f})" + " " * 3 for t in took.values()
                )
                print(f"{rows:>4}{cells}   {err:.1e}")
                if mats is weights and "custom" in ways:
                    blas = min(took["F.linear"], took["W@x^T"])
                    mine = min(took["custom"], took["custom+prefetch"])
                    result[f"custom_vs_blas_b{rows}"] = f"{blas / mine:.2f}"
        print(result_line(result or {"custom_kernel": "skipped"}))


if __name__ == "__main__":
    main()
