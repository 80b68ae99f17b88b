"""The boxes `looprl plan --device` knows, with the memory a run can use on each.

Sizes are what the hardware reports (GPU memory in GiB as `nvidia-smi` counts it; the
DGX Spark's 128 GB of LPDDR5x, which its CPU and GPU share). On a unified box the whole
process counts (Python and its libraries next to the tensors); on a discrete GPU only
what lives on the device does. `cpu-<N>g` and `cuda-<N>g` name any other size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from looprl.errors import ConfigError

GiB = 2**30
# A plan fits when its peak stays under this share of the memory: the rest is for the
# operating system (and, on a GPU, the allocator's cached blocks and fragmentation).
USABLE_SHARE = 0.9


@dataclass(frozen=True)
class Device:
    name: str
    memory: int  # bytes
    kind: str  # "cpu" or "cuda": decides model.dtype=auto (float32 / bfloat16)
    unified: bool  # the process's host memory comes out of the same pool
    about: str

    @property
    def usable(self) -> int:
        return int(self.memory * USABLE_SHARE)


DEVICES = {
    d.name: d
    for d in [
        Device("dgx-spark", 128 * 10**9, "cuda", True, "NVIDIA GB10, 128 GB unified LPDDR5x"),
        Device("h200", 141 * GiB, "cuda", False, "NVIDIA H200, 141 GB HBM3e"),
        Device("h100-80g", 80 * GiB, "cuda", False, "NVIDIA H100 80 GB"),
        Device("a100-80g", 80 * GiB, "cuda", False, "NVIDIA A100 80 GB"),
        Device("a100-40g", 40 * GiB, "cuda", False, "NVIDIA A100 40 GB"),
        Device("l40s", 48 * GiB, "cuda", False, "NVIDIA L40S 48 GB"),
        Device("rtx-5090", 32 * GiB, "cuda", False, "GeForce RTX 5090 32 GB"),
        Device("rtx-4090", 24 * GiB, "cuda", False, "GeForce RTX 4090 24 GB"),
        Device("cpu-24g", 24 * GiB, "cpu", True, "a CPU box with 24 GB of RAM"),
        Device("cpu-64g", 64 * GiB, "cpu", True, "a CPU box with 64 GB of RAM"),
    ]
}


def device(name: str) -> Device:
    """A named device, or `cpu-<N>g` / `cuda-<N>g` for any size."""
    if name in DEVICES:
        return DEVICES[name]
    match = re.fullmatch(r"(cpu|cuda)-(\d+(?:\.\d+)?)g", name)
    if match:
        kind, size = match.group(1), float(match.group(2))
        return Device(name, int(size * GiB), kind, kind == "cpu", f"{size:g} GB ({kind})")
    raise ConfigError(
        f"--device {name!r}: use one of {', '.join(DEVICES)}, or cpu-<N>g / cuda-<N>g"
    )
