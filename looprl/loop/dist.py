"""Several processes: the one place that knows about ranks.

Under `torchrun` every rank runs the whole loop: it plays its own share of the advantage
groups, computes the same metrics from the episodes of all ranks, and takes the same
optimizer steps on gradients summed over all ranks, so the replicas never drift apart.
Rank 0 alone writes the run folder: the writers are wrapped once with `main_only`, and
the loop reads the same for one process or many. With one process every method is a
no-op that returns its input.

Gradients are summed with one explicit all-reduce of the accumulated gradients just
before clipping and the optimizer step, not by DistributedDataParallel hooks: a rank
runs as many micro-batches as its own episodes need (a token budget, the A = 0 episodes
skipped), so ranks run different numbers of backward passes, and DDP's per-backward
reduction with `no_sync` would wait for a backward that never comes on another rank.
With `train.shard: fsdp` the weights are split over the ranks instead and FSDP2 reduces
the gradients (loop/shard.py, which pads the ranks' micro-batch counts for that reason).
"""

from __future__ import annotations

import datetime
import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist
from torch.distributed.tensor import DTensor

from looprl.config import Config
from looprl.errors import ConfigError, LoopRLError

T = TypeVar("T")
TIMEOUT_ENV = "LOOPRL_DIST_TIMEOUT_S"  # how long a collective waits for a missing rank
DEFAULT_TIMEOUT_S = 300.0  # rank 0 writing a large checkpoint keeps the others waiting


class Dist:
    """This process's place among the ranks, and the few collectives the loop needs."""

    def __init__(self, rank: int = 0, world: int = 1, local_rank: int = 0) -> None:
        self.rank = rank
        self.world = world
        self.local_rank = local_rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous share of `items`, in order (shares differ by at most one;
        the concatenation of the shares in rank order is `items`)."""
        start, end = share_bounds(len(items), self.rank, self.world)
        return list(items[start:end])

    def gather(self, items: list[T]) -> list[T]:
        """Every rank's `items` concatenated in rank order, on every rank."""
        if self.world == 1:
            return list(items)
        shares: list[Any] = [None] * self.world
        torch_dist.all_gather_object(shares, items)
        return [item for share in shares for item in share]

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Element-wise sum (or max) of `values` over ranks, in float64."""
        if self.world == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self._device())
        reduce_op = {"sum": torch_dist.ReduceOp.SUM, "max": torch_dist.ReduceOp.MAX}[op]
        torch_dist.all_reduce(tensor, op=reduce_op)
        return tensor.tolist()

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum each parameter's gradient over ranks, in place (one flat buffer, one call).

        Each rank's loss is already divided by the global normaliser (the counts of the
        whole minibatch over all ranks), so the sum is the one-process gradient. A rank
        with nothing to back-propagate contributes zeros. Sharded parameters (DTensors,
        train.shard=fsdp): FSDP2 has reduced their gradients already, nothing to do."""
        if self.world == 1 or not params or hasattr(params[0], "full_tensor"):
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        torch_dist.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(g).to(g.dtype)
            offset += g.numel()

    def broadcast_parameters(self, params: list[torch.nn.Parameter]) -> None:
        """Rank 0's values for `params` on every rank: the replicas start identical.
        Sharded ones (DTensors, train.shard=fsdp) are each rank's own part: left as they are."""
        if self.world == 1:
            return
        with torch.no_grad():
            for p in params:
                if not isinstance(p, DTensor):
                    torch_dist.broadcast(p.data, src=0)

    def barrier(self) -> None:
        if self.world > 1:
            torch_dist.barrier()

    def _device(self) -> torch.device:
        if torch_dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def check_split(cfg: Config, dist: Dist) -> None:
    """Over several processes each rank plays whole groups: the step's tasks must split
    evenly (the eval tasks need not)."""
    if dist.world == 1:
        return
    if cfg.rollout.tasks_per_step % dist.world:
        raise ConfigError(
            f"rollout.tasks_per_step={cfg.rollout.tasks_per_step} does not split over "
            f"{dist.world} processes: each process plays whole groups, so set it to a "
            f"multiple of {dist.world}"
        )


def share_bounds(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of rank's share when n items are split into `world` contiguous runs."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


_current = Dist()


def current() -> Dist:
    """The process's Dist (one process until `start` has joined a torchrun group)."""
    return _current


def start() -> Dist:
    """Join the process group torchrun describes in the environment (WORLD_SIZE, RANK,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT); without torchrun, one process. NCCL when this
    process has a GPU, gloo otherwise. A collective that waits longer than
    LOOPRL_DIST_TIMEOUT_S (300 s by default) for a missing rank fails instead of hanging."""
    global _current
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or torch_dist.is_initialized():
        return _current
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    try:
        timeout_s = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    except ValueError:
        raise ConfigError(f"{TIMEOUT_ENV} must be a number of seconds") from None
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    torch_dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    _current = Dist(rank, world, local_rank)
    return _current


def stop() -> None:
    """Leave the process group (at the end of a run, on every rank). `current()` still
    says which rank this process was, for what it prints after the run."""
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def main_only(fn: Callable[..., T]) -> Callable[..., T | None]:
    """`fn` on rank 0; on the other ranks a call that does nothing and returns None."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T | None:
        return fn(*args, **kwargs) if _current.is_main else None

    return wrapper


def report_failure(err: BaseException) -> None:
    """Say which rank failed and why, before the exception ends this process (torchrun
    then stops the other ranks; one blocked in a collective fails at its timeout).
    looprl's own errors are printed by the command line, on every rank."""
    if _current.world > 1 and not isinstance(err, LoopRLError):
        print(
            f"[rank {_current.rank}] failed: {type(err).__name__}: {err}",
            file=sys.stderr,
            flush=True,
        )
