"""Rollout throughput: looprl's hf engine vs transformers `generate`, side by side.

    .venv/bin/python bench/speed/rollout.py [--model smollm2-135m] [--batches 8,32,64] [--repeats 3]
                                      [--device cpu|cuda] [--vllm auto|on|off]

Same model (float32), same tic-tac-toe prompts (distinct boards: no two requests share
a whole prompt, but all share the system prompt and tool schema), 64 new tokens,
temperature 1, no grammar (so jump-forward does not apply): this measures prefill and
the decoding loop. Columns: looprl's exact float32 engine; the same engine with its
fast linear layers switched off (`F.linear`; shown when the engine's start-up timing
switched weight-first or packed layers on, see looprl.forward.fast_linear); looprl sampling from a
bfloat16 copy (`rollout.sampler_dtype=bfloat16`, not exact: its mean |logprob gap| to
the float32 policy is printed); `generate`, on its own copy of the model. Tokens are
counted up to and including EOS. Prints generated tokens/s (median of the repeats, the
engines interleaved in each repeat) and ends with a `RESULT` line: `rollout_speedup_bN`
(float32 engine / generate), `rollout_speedup_bf16_bN` (bf16 sampler / generate) and
`fast_linear_speedup_bN` (float32 engine / the same with F.linear).

With vLLM installed (`make setup-vllm`; `--vllm auto` uses it when `.venv-vllm` exists)
a `vllm` column times the `vllm` engine on the same model (float32, a server it starts in
eager mode; start-up not counted): `vllm_tokens_per_s_bN` and `looprl_vs_vllm_bN`
(float32 engine / vllm) in the `RESULT` line.

It also prints a floor for the exact engine at each batch size: the model's matrix
products alone (every linear layer and the output projection, with the model's own
weights, on random activations with one row per sequence; timed as F.linear's x @ W^T,
as weight-first W @ x^T and through oneDNN with packed weights, the fastest counting)
for one decode step, times the decode
steps of an average row of the run, plus the engine's measured prefill. No float32
engine doing the same work can beat `floor tok/s` on this machine; `floor_speedup_bN`
is that bound divided by `generate`'s tokens/s. The last column, `step_budget_5x_ms_bN`, is
what one whole decode step (products, attention, sampling, everything) may take for the
engine to reach 5x `generate`, given the run's tokens, steps and prefill; next to it,
`looprl_step_ms_bN`, what the exact engine's decode step took (its tokens/s, less the
prefill). With
`--device cuda` everything runs on the GPU, float32 as on the CPU (the weight-first form
is CPU-only: both columns then time `F.linear`'s kernels, and the floor's forms are both
the GPU's).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from looprl.chat import ChatRenderer
from looprl.engine import GenerationRequest, SamplingParams
from looprl.engine.hf import HFEngine
from looprl.envs import make_env
from looprl.forward.fast_linear import enable as enable_fast_linear
from looprl.forward.fast_linear import enabled as fast_linear_enabled
from looprl.model.load import load_causal_lm, load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import ROOT, arguments, median, result_line

NEW_TOKENS = 64


def prompts(renderer: ChatRenderer, n: int) -> list[list[int]]:
    env = make_env("tictactoe-move", {"tool_choice": "auto"})
    out = []
    for task in env.tasks("train", n=n, seed=7):
        obs = env.reset(task)
        out.append(renderer.prompt_ids(obs.messages, obs.tools))
    return out


def run_looprl(
    engine: HFEngine, batch: list[list[int]], seed: int, new_tokens: int = NEW_TOKENS
) -> tuple[int, float]:
    return run_looprl_outputs(engine, batch, seed, new_tokens)[:2]


def run_looprl_outputs(
    engine: HFEngine, batch: list[list[int]], seed: int, new_tokens: int = NEW_TOKENS
) -> tuple:
    device = getattr(engine, "device", torch.device("cpu"))  # a vllm engine's: its server's
    sync(device)
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=seed)
    start = time.perf_counter()
    outs = engine.generate([GenerationRequest(p) for p in batch], params)
    sync(device)
    return sum(len(o.ids) for o in outs), time.perf_counter() - start, outs


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a timer reads finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def logprob_gap(model, batch: list[list[int]], outs) -> float:
    """Mean |sampler logprob - float32 policy logprob| over the generated tokens."""
    gaps = []
    device = next(model.parameters()).device
    for prompt, out in zip(batch[:8], outs[:8]):
        ids = torch.tensor([prompt + out.ids], device=device)
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float().cpu()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.ids)[:, None])
        gaps.append((ref.squeeze(-1) - torch.tensor(out.logprobs)).abs().mean().item())
    return statistics.mean(gaps)


@torch.inference_mode()
def matmul_floor(model, rows: int, repeats: int = 5) -> tuple[float, float, float]:
    """Seconds of one decode step's matrix products at `rows` rows (median of repeats), as
    F.linear (x @ W^T), weight-first (W @ x^T) and through oneDNN with each weight packed
    once (see looprl.forward.fast_linear; inf where oneDNN or the device lacks it)."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    device = weights[0].device
    inputs = [torch.randn(rows, w.shape[1], device=device) for w in weights]
    mkldnn = getattr(torch.ops, "mkldnn", None)
    packed = None
    if device.type == "cpu" and torch.backends.mkldnn.is_available() and mkldnn is not None:
        packed = [mkldnn._reorder_linear_weight(w, 64) for w in weights]
    forms = ["plain", "first"] + (["packed"] if packed else [])
    times: dict[str, list[float]] = {form: [] for form in forms}
    for _ in range(repeats + 1):
        for form in forms:
            sync(device)
            start = time.perf_counter()
            for i, (x, w) in enumerate(zip(inputs, weights)):
                if form == "first":
                    torch.mm(w, x.t())
                elif form == "packed":
                    mkldnn._linear_pointwise(x, packed[i], None, "none", [], "")
                else:
                    torch.nn.functional.linear(x, w)
            sync(device)
            times[form].append(time.perf_counter() - start)
    seconds = {form: median(t[1:]) for form, t in times.items()}
    return seconds["plain"], seconds["first"], seconds.get("packed", float("inf"))


@torch.inference_mode()
def prefill_seconds(engine: HFEngine, batch: list[list[int]], repeats: int = 3) -> float:
    from looprl.forward.prefix import shared_prefill

    times = []
    for _ in range(repeats):
        sync(engine.device)
        start = time.perf_counter()
        shared_prefill(engine.model, batch, engine.pad_id, engine.device)
        sync(engine.device)
        times.append(time.perf_counter() - start)
    return median(times)


@torch.inference_mode()
def run_generate(
    model, tokenizer, batch: list[list[int]], seed: int, new_tokens: int = NEW_TOKENS
) -> tuple[int, float]:
    longest = max(len(p) for p in batch)
    pad = tokenizer.pad_token_id
    device = next(model.parameters()).device
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in batch], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch], device=device)
    torch.manual_seed(seed)
    sync(device)
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
        top_k=0, max_new_tokens=new_tokens, pad_token_id=pad,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )  # fmt: skip
    sync(device)
    seconds = time.perf_counter() - start
    new = out[:, longest:]
    # tokens produced before (and including) each row's EOS
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    produced = 0
    for row in new.tolist():
        produced += row.index(eos) + 1 if eos in row else len(row)
    return produced, seconds


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", default="8,32,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vllm", choices=["auto", "on", "off"], default="auto")
    args = parser.parse_args()
    device = torch.device(args.device)
    tokenizer = load_tokenizer(args.model)
    model = load_causal_lm(args.model, torch.float32).to(device).eval()
    renderer = ChatRenderer(tokenizer, model_name=args.model)
    # `generate` gets its own copy: the engines switch attention and linear layers of theirs
    reference = load_causal_lm(args.model, torch.float32).to(device).eval()
    exact = HFEngine(model, tokenizer, renderer.eos_ids, batch_size=256)
    bf16 = HFEngine(model, tokenizer, renderer.eos_ids, batch_size=256, sampler_dtype="bfloat16")
    sizes = [int(b) for b in args.batches.split(",")]
    pool = prompts(renderer, max(sizes))
    vllm = start_vllm(args.vllm, model, tokenizer, renderer, max(len(p) for p in pool))
    for engine in (exact, bf16, *([vllm] if vllm else [])):  # warm-up
        run_looprl(engine, pool[:2], 0)
    run_generate(reference, tokenizer, pool[:2], 0)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{where}, {torch.get_num_threads()} threads; tokens/s, median of {args.repeats}")
    print(
        f"fast linear layers: float32 engine {fast_linear_enabled(model)},"
        f" bf16 sampler {fast_linear_enabled(bf16.model)}"
    )
    header = f"{'batch':>5} {'looprl':>8} {'F.linear':>9} {'bf16 sampler':>13} {'generate':>9}"
    print(header + f" {'ratio':>6} {'ratio bf16':>11} {'bf16 |gap|':>11} {'vllm':>7}")
    result = {}
    floors = []
    for size in sizes:
        batch = pool[:size]
        ours, linear, fast, theirs, gaps, produced, served = [], [], [], [], [], [], []
        for r in range(args.repeats):
            n, s = run_looprl(exact, batch, r)
            ours.append(n / s)
            produced.append(n)
            if exact.weight_first or exact.packed:  # the same engine with nn.Linear's form
                enable_fast_linear(model, weight_first=False, packed=False)
                n, s = run_looprl(exact, batch, r)
                linear.append(n / s)
                enable_fast_linear(model, weight_first=exact.weight_first, packed=exact.packed)
            n, s, outs = run_looprl_outputs(bf16, batch, r)
            fast.append(n / s)
            gaps.append(logprob_gap(reference, batch, outs))
            n, s = run_generate(reference, tokenizer, batch, r)
            theirs.append(n / s)
            if vllm is not None:
                n, s = run_looprl(vllm, batch, r)
                served.append(n / s)
        a, f, b = median(ours), median(fast), median(theirs)
        plain = f"{median(linear):>9.1f}" if linear else f"{'-':>9}"
        print(
            f"{size:>5} {a:>8.1f} {plain} {f:>13.1f} {b:>9.1f} {a / b:>6.2f} {f / b:>11.2f}"
            f" {statistics.mean(gaps):>11.4f}"
            + (f" {median(served):>7.1f}" if served else f" {'-':>7}")
        )
        if served:
            v = median(served)
            result[f"vllm_tokens_per_s_b{size}"] = f"{v:.1f}"
            result[f"looprl_vs_vllm_b{size}"] = f"{a / v:.2f}"
        if linear:
            result[f"fast_linear_speedup_b{size}"] = f"{a / median(linear):.2f}"
        floors.append((size, a, b, median(produced), exact, batch))
        result[f"rollout_speedup_b{size}"] = f"{a / b:.2f}"
        result[f"rollout_speedup_bf16_b{size}"] = f"{f / b:.2f}"
        result[f"looprl_tok_s_b{size}"] = f"{a:.1f}"
        result[f"looprl_bf16_tok_s_b{size}"] = f"{f:.1f}"
        result[f"generate_tok_s_b{size}"] = f"{b:.1f}"
    print(
        "floor of the exact engine: matrix products of each decode step (the fastest of"
        " x @ W^T, W @ x^T and packed) + measured prefill"
    )
    print(
        f"{'batch':>5} {'tokens':>7} {'steps/row':>10} {'x@W^T ms/step':>14} {'W@x^T ms/step':>14}"
        f" {'packed ms/step':>15}"
        f" {'prefill s':>10} {'floor tok/s':>12} {'ratio':>6} {'5x budget ms/step':>18}"
        f" {'looprl ms/step':>15}"
    )
    for size, looprl_tok_s, generate_tok_s, tokens, engine, batch in floors:
        plain, first, packed = matmul_floor(engine.model, size)
        prefill = prefill_seconds(engine, batch)
        steps = tokens / size - 1  # decode steps of an average row (its first token: prefill)
        floor = tokens / (prefill + steps * min(plain, first, packed))
        ratio = floor / generate_tok_s
        # what one whole decode step may take for the engine to reach 5x generate, and
        # what it took (the engine's tokens/s above, less this prefill)
        budget = (tokens / (5 * generate_tok_s) - prefill) / steps
        took = (tokens / looprl_tok_s - prefill) / steps
        print(
            f"{size:>5} {tokens:>7.0f} {steps:>10.1f} {plain * 1e3:>14.1f} {first * 1e3:>14.1f}"
            f" {packed * 1e3:>15.1f}"
            f" {prefill:>10.2f} {floor:>12.1f} {ratio:>6.2f} {budget * 1e3:>18.1f}"
            f" {took * 1e3:>15.1f}"
        )
        result[f"floor_speedup_b{size}"] = f"{ratio:.2f}"
        result[f"step_budget_5x_ms_b{size}"] = f"{budget * 1e3:.1f}"
        result[f"looprl_step_ms_b{size}"] = f"{took * 1e3:.1f}"
    print(result_line(result))
    if vllm is not None:
        vllm.close()


def start_vllm(mode: str, model, tokenizer, renderer: ChatRenderer, longest: int):
    """The vllm engine on this model (float32, eager), or None when off or not installed."""

    python = ROOT / ".venv-vllm" / "bin" / "python"
    if mode == "off" or (mode == "auto" and not python.is_file()):
        return None
    from looprl.engine.vllm import VLLMEngine
    from looprl.engine.vllm_server import LaunchSpec

    spec = LaunchSpec(str(python), Path(), "float32", longest + NEW_TOKENS + 8, kv_cache_gb=2.0)
    return VLLMEngine.launch(model, tokenizer, renderer.eos_ids, spec)


if __name__ == "__main__":
    main()
