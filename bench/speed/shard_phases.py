"""A rank's resident set at each point of a short sharded update (`train.shard: fsdp`):
loaded, sharded, with the whole weights gathered, resharded, after each of two updates;
the peak so far beside each. SmolLM2-135M, full fine-tuning, 2 tasks × 2 built episodes
of 32 generated tokens (bench/speed/update_memory.py's), the default micro-batches.

    torchrun --nproc_per_node 2 bench/speed/shard_phases.py fsdp
    .venv/bin/python bench/speed/shard_phases.py none      # one process, for comparison

Each rank ends with `RESULT rank=R shard=S` and `POINT=resident_gb/peak_gb` fields.
Not a test: it loads the real model; a minute or two on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import print_result
from bench.speed.update_memory import episodes
from looprl.config import load_config
from looprl.loop.dist import start, stop
from looprl.loop.optim import make_optimizer
from looprl.loop.policy import load_policy
from looprl.loop.shard import full_weights, start_replicas
from looprl.loop.update import UpdateState, update_policy


def resident() -> str:
    """This process's resident set now and its peak so far, GB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    now = pages * resource.getpagesize() / 1e9
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return f"{now:.2f}/{peak:.2f}"


def main(shard: str) -> None:
    dist = start()
    points = {"start": resident()}
    cfg = load_config(
        None,
        [
            "model.name=smollm2-135m",
            "model.lora.enabled=false",
            f"train.shard={shard}",
            "rollout.tasks_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=32",
        ],
    )
    policy = load_policy(cfg)
    points["loaded"] = resident()
    start_replicas(policy.model, cfg.train, policy.device, dist)
    points["sharded"] = resident()
    with full_weights(policy.model):
        points["whole"] = resident()
    points["resharded"] = resident()
    groups = episodes(cfg, policy, 32)
    optimizer = make_optimizer(policy.trainable_parameters(), "adamw", 1e-6, 0.0)
    for step in range(2):
        update_policy(
            policy,
            optimizer,
            dist.share(groups),
            cfg.algo,
            cfg.train,
            group_size=2,
            max_tokens=32,
            seed=step,
            state=UpdateState(cfg.train.micro_batch_tokens),
            dist=dist,
        )
        points[f"update{step + 1}"] = resident()
    print_result({"rank": dist.rank, "shard": shard, **points})
    stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shard", nargs="?", default="fsdp", choices=["fsdp", "none"])
    main(parser.parse_args().shard)
