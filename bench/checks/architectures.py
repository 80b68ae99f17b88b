"""The engine/trainer logprob gap on each tiny architecture, and how often MoE routing
differs between the rollout and the update.

For each architecture of `looprl.model.tiny` (LoRA added as a run adds it, adapters
non-zero): tic-tac-toe prompts are sampled through the `hf` engine, then scored by the
trainer (`sequence_logprobs`); the gap is |engine logprob - trainer logprob| over the
sampled tokens. With `--sampler-dtype bfloat16` the engine samples from a bf16 copy (as
`rollout.sampler_dtype=bfloat16` does). For MoE models, `routing differs` is the share of
(token, layer) pairs whose chosen experts differ between the rollout (the sampling
model: prefill, then one cached decode step per token) and the update (the trainer's
model, one full forward), on one sampled sequence per prompt: the mismatch routing replay
would remove.

    python bench/checks/architectures.py [--sampler-dtype bfloat16] [--archs qwen3_moe,mixtral]
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

from looprl.chat import ChatRenderer
from looprl.config import LoraConfig
from looprl.engine import GenerationRequest, SamplingParams
from looprl.engine.hf import HFEngine
from looprl.envs import make_env
from looprl.forward.score import sequence_logprobs
from looprl.loop.policy import add_lora
from looprl.model.arch import router_modules
from looprl.model.load import load_tokenizer
from looprl.model.tiny import TINY_ARCHITECTURES, build_tiny, perturb_adapters

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import arguments, result_line


def chosen_experts(model, sequence: list[int], prompt_len: int | None) -> list[torch.Tensor]:
    """Per router, the sorted expert indices [N, k] of every token of `sequence`: from one
    full forward (`prompt_len` None, as the trainer runs it), or from a prefill of the
    prompt and then one cached decode step per token (as the engine runs it)."""
    calls: list[list[torch.Tensor]] = []
    routers = list(router_modules(model.get_base_model()).values())
    hooks = [
        router.register_forward_hook(lambda m, a, out, i=i: calls[-1][i].append(out[-1]))
        for i, router in enumerate(routers)
    ]
    ids = torch.tensor([sequence])
    with torch.inference_mode():  # a bf16 sampler copy is made of inference tensors
        if prompt_len is None:
            calls.append([[] for _ in routers])
            model(ids)
        else:
            calls.append([[] for _ in routers])
            cache = model(ids[:, :prompt_len], use_cache=True).cache
            for t in range(prompt_len, len(sequence)):
                calls.append([[] for _ in routers])
                cache = model(ids[:, t : t + 1], cache=cache, use_cache=True).cache
    for hook in hooks:
        hook.remove()
    return [
        torch.cat([t.reshape(-1, t.shape[-1]) for call in calls for t in call[i]]).sort(-1).values
        for i in range(len(routers))
    ]


def measure(arch: str, tokenizer, renderer, sampler_dtype: str | None) -> dict[str, float]:
    model = perturb_adapters(add_lora(build_tiny(arch, tokenizer), LoraConfig(rank=8, alpha=16.0)))
    env = make_env("tictactoe-move", {"tool_choice": "auto"})
    requests = []
    for task in env.tasks("train", n=4, seed=3):
        obs = env.reset(task)
        requests += [GenerationRequest(renderer.prompt_ids(obs.messages, obs.tools))] * 4
    engine = HFEngine(model, tokenizer, renderer.eos_ids, sampler_dtype=sampler_dtype)
    outs = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=48, seed=1))
    sequences = [r.prompt_ids + o.ids for r, o in zip(requests, outs)]
    masks = [[0] * len(r.prompt_ids) + [1] * len(o.ids) for r, o in zip(requests, outs)]
    with torch.no_grad():
        logp, mask = sequence_logprobs(model, sequences, masks, 0, torch.device("cpu"), 1.0)
    gap = (logp[mask] - torch.tensor([lp for o in outs for lp in o.logprobs])).abs()
    row = {"tokens": int(mask.sum()), "gap_max": gap.max().item(), "gap_mean": gap.mean().item()}
    if router_modules(model):
        differs = total = 0
        for request, sequence in zip(requests[::4], sequences[::4]):
            rollout = chosen_experts(engine.model, sequence, len(request.prompt_ids))
            update = chosen_experts(model, sequence, None)
            for a, b in zip(rollout, update):
                differs += int((a != b).any(-1).sum())
                total += a.shape[0]
        row["routing_differs"] = differs / total
    return row


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--sampler-dtype", default=None, choices=[None, "bfloat16", "float16"])
    parser.add_argument("--archs", default=",".join(TINY_ARCHITECTURES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    tokenizer = load_tokenizer("tiny-random")
    renderer = ChatRenderer(tokenizer, model_name="tiny-random")
    results = {}
    print(f"{'arch':16} {'tokens':>6} {'gap max':>10} {'gap mean':>10} {'routing differs':>16}")
    for arch in args.archs.split(","):
        row = results[arch] = measure(arch, tokenizer, renderer, args.sampler_dtype)
        routing = f"{row['routing_differs']:.2%}" if "routing_differs" in row else "-"
        print(f"{arch:16} {row['tokens']:6d} {row['gap_max']:10.2e} {row['gap_mean']:10.2e} "
              f"{routing:>16}")  # fmt: skip
    worst = max(row["gap_max"] for row in results.values())
    routed = [row["routing_differs"] for row in results.values() if "routing_differs" in row]
    print(result_line({"sampler_dtype": args.sampler_dtype or "model", "gap_max": f"{worst:.3e}",
                       "routing_differs_max": f"{max(routed, default=0.0):.4f}"}))  # fmt: skip


if __name__ == "__main__":
    main()
