"""Sampling's linear layers on the CPU, in the fastest exact form this machine has.

Without autograd, on the CPU, a linear layer can run in three forms that give the same
products up to float summation order:

- `F.linear(x, W)`: BLAS gets the weight as the transposed right operand of x @ W^T.
- weight-first, W @ x^T read back transposed: the same dot products, another loop order.
  For a few rows the MKL in PyTorch's CPU wheel runs it markedly faster than F.linear on
  this project's 2-core AMD EPYC (1.15-1.6x at 8-64 rows with SmolLM2-135M's weights).
- packed: the weight copied once into oneDNN's blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`) and multiplied by oneDNN's linear primitive.
  With SmolLM2-135M's weights, one pass over every layer took 28 / 34 / 46 / 100 ms at
  1 / 13 / 24 / 64 rows against 43 / 76 / 77 / 123 ms for the better of the other two,
  and 1.4x / 1.23x less than F.linear for a prefill's 256 / 600 rows. The copy costs one
  more copy of the layers' weights while it exists (0.54 GB for SmolLM2-135M in float32)
  and ≈ 0.25 s to make on that machine.

`enable(model)` turns the model's plain `nn.Linear` modules into `FastLinear` (same
parameters, same state dict) and switches each form on only where a timing on the
model's own weights at a decode batch finds it faster (`weight_first=` / `packed=`
True/False skip the timing; a LoRA layer is timed with its adapter's products beside the
base product, against one product with its merged copy). Packed copies exist only
between `pack(model)` and `unpack(model)`: the engine packs when a generation starts and
unpacks when it (or its multi-turn session) ends, so training never holds them (a
server's open batch keeps them). Under PEFT LoRA, `pack` gives each adapted layer one
copy of its merged weight W + scaling * B @ A instead (`MergedLora`): sampling then
costs one product per layer, not PEFT's three plus a scale and a sum. A layer whose
weights changed in place since they were packed (an optimizer step, a copied state dict)
packs them again at its next call. With autograd, on other devices, and for inputs of
another dtype, every form falls back to `F.linear` (PEFT's own forward for adapted
layers).
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# above this many rows F.linear is as fast or faster than weight-first (equal at ≈ 1,000)
MAX_ROWS = 256
# models whose linear weights are smaller than this stay cache-resident: nothing to win
MIN_WEIGHT_BYTES = 64 * 2**20
# weights timed per form: more than any last-level cache, so the timing reads memory
CALIBRATION_BYTES = 256 * 2**20
CALIBRATION_ROWS = 8
SPEEDUP_NEEDED = 1.05
# the decode batch oneDNN lays the packed weight out for (it serves any number of rows)
PACK_ROWS = 64

_ONEDNN = getattr(torch.ops, "mkldnn", None)
_REORDER = getattr(_ONEDNN, "_reorder_linear_weight", None) if _ONEDNN is not None else None
_PACKED_LINEAR = getattr(_ONEDNN, "_linear_pointwise", None) if _ONEDNN is not None else None
PACKED_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class Forms:
    """Which faster forms a model's linear layers use (both False: plain `nn.Linear`)."""

    weight_first: bool = False
    packed: bool = False

    def __bool__(self) -> bool:
        return self.weight_first or self.packed


class FastLinear(torch.nn.Linear):
    """`nn.Linear` whose no-grad CPU products take the forms switched on (module doc)."""

    _weight_first = False
    _packs = False  # whether `pack` makes a packed copy of this layer
    _packed: torch.Tensor | None = None  # the copy, between `pack` and `unpack`
    _packed_key: tuple[int, int] | None = None  # the weight it was made from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        if self._packed is not None and x.dtype == self._packed.dtype:
            if self._packed_key != _key(self.weight):  # changed in place since packed
                self._pack()
            return _PACKED_LINEAR(_row_major(x), self._packed, self.bias, "none", [], "")
        rows = x.numel() // x.shape[-1] if x.dim() >= 2 else MAX_ROWS + 1
        if not self._weight_first or rows > MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        x_KR = _row_major(x).reshape(rows, x.shape[-1]).t()
        if self.bias is None:
            out_NR = torch.mm(self.weight, x_KR)
        else:
            out_NR = torch.addmm(self.bias[:, None], self.weight, x_KR)
        return out_NR.t().view(*x.shape[:-1], out_NR.shape[0])

    def _pack(self) -> None:
        with torch.no_grad():
            self._packed = _REORDER(self.weight.detach(), PACK_ROWS)
        self._packed_key = _key(self.weight)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (`copy.deepcopy`, pickling) carries no packed copy: oneDNN's tensors
        have no storage to copy, and the copy packs its own weights when asked."""
        state = dict(super().__getstate__())
        state.pop("_packed", None)
        state.pop("_packed_key", None)
        return state


class MergedLora:
    """Mixed into a PEFT LoRA linear layer between `pack` and `unpack`: without autograd,
    with its one plain adapter active and in eval mode, the layer runs as one packed
    product with W + scaling * B @ A, the merged weight PEFT's own `merge` would write
    (equal to base plus adapter up to float rounding), instead of the base product, two
    adapter products, a scale and a sum. Anything else (gradients, adapters disabled or
    switched, dropout in training mode, PEFT's extra arguments) takes PEFT's forward."""

    _merged: torch.Tensor | None = None
    _merged_key: tuple | None = None

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if (
            self._merged is None
            or args
            or kwargs
            or torch.is_grad_enabled()
            or self.training
            or self.disable_adapters
            or x.dtype != self._merged.dtype
            or x.device.type != "cpu"
        ):
            return super().forward(x, *args, **kwargs)  # type: ignore[misc]
        key = _lora_key(self)
        if key is None:  # adapters switched, merged by PEFT, ...
            return super().forward(x, *args, **kwargs)  # type: ignore[misc]
        if key != self._merged_key:  # a weight changed in place since merged
            self._merge()
        return _PACKED_LINEAR(_row_major(x), self._merged, self.base_layer.bias, "none", [], "")

    def _merge(self) -> None:
        adapter = self.active_adapters[0]
        with torch.no_grad():
            weight = self.base_layer.weight.detach()
            delta = self.get_delta_weight(adapter).to(weight.dtype)
            self._merged = _REORDER(weight + delta, PACK_ROWS)
        self._merged_key = _lora_key(self)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())  # type: ignore[misc]
        state.pop("_merged", None)
        state.pop("_merged_key", None)
        return state


_MERGED_CLASSES: dict[type, type] = {}


def _lora_key(layer: Any) -> tuple | None:
    """What a merged copy was made from: the active adapter, its scaling and the three
    weights' current values (None where the layer's state cannot be merged)."""
    if not _plain_adapter(layer):
        return None
    adapter = layer.active_adapters[0]
    return (
        adapter,
        layer.scaling[adapter],
        _key(layer.base_layer.weight),
        _key(layer.lora_A[adapter].weight),
        _key(layer.lora_B[adapter].weight),
    )


def _lora_over_linear(layer: Any) -> bool:
    """A PEFT LoRA layer over a plain (or fast) linear layer."""
    return (
        type(layer).__module__.startswith("peft.")
        and hasattr(layer, "get_delta_weight")
        and type(getattr(layer, "base_layer", None)) in (torch.nn.Linear, FastLinear)
    )


def _is_lora_linear(layer: Any) -> bool:
    """A PEFT LoRA linear layer over a packing `FastLinear`."""
    return (
        _lora_over_linear(layer)
        and type(layer.base_layer) is FastLinear
        and layer.base_layer._packs
    )


def _adapters(model: Any) -> dict[int, tuple[torch.nn.Module, torch.nn.Module, float]]:
    """Per base layer (by id) that `pack` would merge with its LoRA adapter: the
    adapter's A and B layers and its scaling."""
    out = {}
    for m in model.modules():
        if _lora_over_linear(m) and _plain_adapter(m):
            name = m.active_adapters[0]
            out[id(m.base_layer)] = (m.lora_A[name], m.lora_B[name], float(m.scaling[name]))
    return out


def _plain_adapter(layer: Any) -> bool:
    """One plain adapter active (no DoRA or other variant, no adapter bias, no
    transposed weights), not merged into the base weight by PEFT itself."""
    active = list(getattr(layer, "active_adapters", []))
    return (
        not getattr(layer, "merged", True)
        and len(active) == 1
        and active[0] in getattr(layer, "lora_A", {})
        and active[0] not in getattr(layer, "lora_variant", {})
        and not getattr(layer, "lora_bias", {}).get(active[0], False)
        and not getattr(layer, "fan_in_fan_out", False)
    )


def _row_major(x: torch.Tensor) -> torch.Tensor:
    """`x` with each row's features adjacent in memory. A weight-first layer's output is
    a transposed view, and elementwise ops keep that layout (an MLP's act(gate) * up), so
    the next layer would get its input column-major: MKL's W @ x^T then took ≈ 1.8x as
    long for SmolLM2-135M's down projection at 8 rows (700 against 390 µs a call in the
    engine, one probe) as after this copy of a few rows."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _key(weight: torch.Tensor) -> tuple[int, int]:
    """Identifies a weight's current values: its memory and its in-place update count
    (inference tensors count none: nothing may change them outside inference mode)."""
    return weight.data_ptr(), -1 if weight.is_inference() else weight._version


def linears(model: Any) -> list[torch.nn.Linear]:
    """The model's plain linear layers (subclasses such as quantized layers excluded)."""
    kinds = (torch.nn.Linear, FastLinear)
    return [m for m in model.modules() if type(m) in kinds]


def packing_supported(weights: list[torch.Tensor]) -> bool:
    """Whether this PyTorch and this CPU have oneDNN's packed linear for these (CPU)
    weights."""
    return all(w.device.type == "cpu" and packs_dtype(w.dtype) for w in weights)


@functools.cache
def packs_dtype(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and multiplies weights of `dtype` on this CPU, tried once on
    a small weight: bfloat16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, which many
    AVX2 machines lack (there the reorder raises)."""
    if (
        _REORDER is None
        or _PACKED_LINEAR is None
        or not torch.backends.mkldnn.is_available()
        or dtype not in PACKED_DTYPES
    ):
        return False
    try:
        with torch.no_grad():
            packed = _REORDER(torch.zeros(16, 16, dtype=dtype), PACK_ROWS)
            _PACKED_LINEAR(torch.zeros(2, 16, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def enable(model: Any, weight_first: bool | None = None, packed: bool | None = None) -> Forms:
    """Switch the model's linear layers to the forms that are measurably faster here
    (True/False for a form skips its measurement) and return the forms now on. Models on
    other devices and small models keep `nn.Linear` unless a form is forced."""
    unpack(model)
    layers = linears(model)
    weights = [m.weight for m in layers]
    worth = (
        bool(weights)
        and all(w.device.type == "cpu" for w in weights)
        and sum(w.numel() * w.element_size() for w in weights) >= MIN_WEIGHT_BYTES
    )
    if packed is None:
        packed = worth and packing_supported(weights)
    elif packed and not packing_supported(weights):
        packed = False
    if weight_first is None or packed:
        # timed on the model's own weights as sampling would run them: a LoRA layer's
        # base product with its adapter's two products, a scale and a sum in the other
        # forms, one product with the packed (merged) copy
        adapters = _adapters(model)
        own = {id(a) for found in adapters.values() for a in found[:2]}
        base = [(m.weight, adapters.get(id(m))) for m in layers if id(m) not in own]
        timed = _timings(base, packed) if worth and base else {}
        plain = timed.get("plain", 0.0)
        if weight_first is None:
            weight_first = bool(timed) and plain >= SPEEDUP_NEEDED * timed["weight_first"]
        if packed and timed:
            best = min(plain, timed["weight_first"] if weight_first else plain)
            packed = best >= SPEEDUP_NEEDED * timed["packed"]
    forms = Forms(bool(weight_first), bool(packed))
    for m in layers:
        m.__class__ = FastLinear if forms else torch.nn.Linear
        if forms:
            m._weight_first, m._packs = forms.weight_first, forms.packed
    return forms


def enabled(model: Any) -> Forms:
    layers = [m for m in model.modules() if type(m) is FastLinear]
    return Forms(any(m._weight_first for m in layers), any(m._packs for m in layers))


def pack(model: Any) -> None:
    """Make the packed copies of the layers that use them (those already packed from the
    same weights are kept). A LoRA layer over such a layer gets one copy of its merged
    weight instead (`MergedLora`), and its base layer none."""
    merged: set[int] = set()
    for m in model.modules():
        if not isinstance(m, MergedLora) and not _is_lora_linear(m):
            continue
        key = _lora_key(m)
        if key is None:  # PEFT's forward, and a packed base layer
            if isinstance(m, MergedLora):
                m._merged = m._merged_key = None
            continue
        if not isinstance(m, MergedLora):
            cls = type(m)
            if cls not in _MERGED_CLASSES:
                _MERGED_CLASSES[cls] = type(f"Merged{cls.__name__}", (MergedLora, cls), {})
            m.__class__ = _MERGED_CLASSES[cls]
        if m._merged_key != key:
            m._merge()
        merged.add(id(m.base_layer))  # neither it nor the adapters' layers run meanwhile
        merged.update(id(a) for a in (*m.lora_A.values(), *m.lora_B.values()))
    for m in model.modules():
        own = type(m) is FastLinear and m._packs and id(m) not in merged  # not merged above
        if own and m._packed_key != _key(m.weight):
            m._pack()


def unpack(model: Any) -> None:
    """Drop every packed copy (the layers keep their other forms; LoRA layers are
    PEFT's own again)."""
    for m in model.modules():
        if type(m) is FastLinear and m._packed is not None:
            m._packed = m._packed_key = None
        elif isinstance(m, MergedLora):
            m._merged = m._merged_key = None
            m.__class__ = type(m).__mro__[2]


@torch.no_grad()
def _timings(
    layers: list[tuple[torch.Tensor, Any]], packed: bool, repeats: int = 5
) -> dict[str, float]:
    """Seconds of one pass over (a memory-sized share of) the layers in each form at
    `CALIBRATION_ROWS` rows, the forms interleaved (the median of `repeats`). A layer is
    its weight and its LoRA adapter (A, B, scaling) or None: the adapter's products run
    beside the base product in the plain and weight-first forms, not in the packed one
    (which `pack` merges)."""
    chosen, size = [], 0
    for weight, adapter in layers:
        chosen.append((weight, adapter))
        size += weight.numel() * weight.element_size()
        if size >= CALIBRATION_BYTES:
            break
    inputs = {
        (w.shape[1], w.dtype): torch.randn(CALIBRATION_ROWS, w.shape[1], dtype=w.dtype)
        for w, _ in chosen
    }
    copies = [_REORDER(w.detach(), PACK_ROWS) for w, _ in chosen] if packed else []

    def seconds(form: str) -> float:
        start = time.perf_counter()
        for i, (w, adapter) in enumerate(chosen):
            x = inputs[(w.shape[1], w.dtype)]
            if form == "packed":
                _PACKED_LINEAR(x, copies[i], None, "none", [], "")
                continue
            out = torch.mm(w, x.t()).t() if form == "weight_first" else F.linear(x, w)
            if adapter is not None:  # PEFT's LoRA forward: base + B(A(x)) * scaling
                lora_a, lora_b, scaling = adapter
                out = out + F.linear(F.linear(x, lora_a.weight), lora_b.weight) * scaling
        return time.perf_counter() - start

    forms = ["plain", "weight_first"] + (["packed"] if packed else [])
    for _ in range(2):  # warm-up (after one pass, a first timing measured a smaller gap)
        for form in forms:
            seconds(form)
    times: dict[str, list[float]] = {form: [] for form in forms}
    for _ in range(repeats):
        for form in forms:
            times[form].append(seconds(form))
    return {form: statistics.median(t) for form, t in times.items()}
