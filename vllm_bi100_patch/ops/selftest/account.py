"""The device-independent account of one kernel call: launches, bytes moved, FLOPs.

On a GPU in eager mode (CoreX forces it) every aten op that is not a view is one kernel
launch with a host cost of its own, and every byte it reads or writes crosses HBM; a CPU's
wall clock hides both.  ``Account`` is a ``TorchDispatchMode`` that counts them for
whatever runs inside it, on any device (CPU tensors with the GPU compute mode forced stand
in for the card):

- **launches**: every aten op except views (``OpOverload.is_view`` and the few aliasing ops
  whose schema does not say so), allocations without a kernel (``empty*``) and metadata
  ops.  A host read (``aten._local_scalar_dense``: ``.item()``, ``int(t)``, ``bool(t)``) is
  not a launch; it is counted in ``host_reads`` (on a device it is a synchronisation).
- **bytes**: per launch, the distinct tensors it touches (inputs and outputs), each counted
  once by the elements it addresses (a broadcast dimension, stride 0, counts once): an
  in-place operand that is read and written counts once.  An index op (``index_select``,
  ``index``, ``gather``, ``embedding``) reads what it selects plus its index and writes its
  result; an indexed write (``index_copy_``, ``index_put_``, ``scatter``) reads and writes
  what it stores, plus its index.  This is the convention of the launch-and-byte table in
  the project's issue 19 (the figures of that table are reproduced exactly by it).
- **FLOPs**: matrix products (``torch.utils.flop_counter``'s formulas: ``2 m n k``; in-place
  ``baddbmm_``/``addmm_`` by their out-of-place formula; fused attention ``2 m n k`` for
  each of its two products, over every query head) plus one per output element of every
  other arithmetic op; copies, gathers and fills count 0.

``predict(account, device)`` turns an account into a modelled time: per launch, the larger
of its bytes over the bandwidth and its FLOPs over the peak, plus a fixed host cost per
launch.  It is a model, labelled as such wherever it is printed, never a measurement.

Part of the package since ``selftest`` prints every timing with its account (it imports
private torch modules: ``selftest`` reports no account where they are missing); also used by
the benchmark and by the tests that hold the kernels' launch and byte budgets
(``tools/account.py`` re-exports it, with the benchmark's ``HalfGemmsInFloat``).  Needs
torch >= 2.1.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

try:  # torch >= 2.1
    from torch.utils.flop_counter import flop_registry as _FLOPS
except ImportError:  # pragma: no cover - older torch
    _FLOPS = {}

__all__ = ["Account", "DEVICES", "DeviceModel", "FREE_OPS", "Launch", "predict"]

_aten = torch.ops.aten

#: Ops that allocate or describe a tensor without running a kernel.
_FREE = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_",
    "set_", "lift_fresh", "detach", "alias", "_unsafe_view", "view", "_reshape_alias",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
    "_has_compatible_shallow_copy_type", "record_stream", "_version",
}
#: Public name of the ops that are not launches (besides views): used by the profiler
#: comparison in ``scripts/profile_kernels.py``.
FREE_OPS = frozenset(_FREE)
#: Index ops that read only what they select (plus the index).
_GATHERS = {"index_select", "index", "gather", "embedding", "take"}
#: Indexed writes: they write (and read) only the values they store (plus the index).
_SCATTERS = {"index_copy_", "index_copy", "index_put_", "index_put", "_index_put_impl_",
             "scatter_", "scatter", "scatter_add_", "scatter_add", "index_add_", "index_add"}
#: Ops that move or make data without arithmetic (0 FLOPs).
_NO_ARITH = {"copy_", "clone", "_to_copy", "contiguous", "fill_", "zero_", "zeros", "ones",
             "full", "zeros_like", "ones_like", "full_like", "arange", "index_select", "index",
             "gather", "embedding", "take", "cat", "stack", "scalar_tensor", "lift_fresh_copy",
             "_local_scalar_dense", "repeat_interleave", "repeat", "expand_copy",
             "permute_copy"} | _SCATTERS


def _accessed_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements ``t`` addresses: a broadcast (stride-0) dimension counts once."""
    if t.numel() == 0:
        return 0
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _tensors(obj: Any) -> List[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


@dataclasses.dataclass(frozen=True)
class Launch:
    """One counted op: its name, the bytes it moves, its FLOPs."""

    name: str
    bytes: int
    flops: int


class Account(TorchDispatchMode):
    """``with Account() as acc: fn()`` then ``acc.launches``, ``acc.bytes``, ``acc.flops``,
    ``acc.host_reads``, ``acc.by_op`` (launches per op name), ``acc.log`` (every launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: List[Launch] = []
        self.host_reads = 0

    @property
    def launches(self) -> int:
        return len(self.log)

    @property
    def bytes(self) -> int:
        return sum(launch.bytes for launch in self.log)

    @property
    def flops(self) -> int:
        return sum(launch.flops for launch in self.log)

    @property
    def by_op(self) -> Dict[str, int]:
        return dict(Counter(launch.name for launch in self.log))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if getattr(func, "is_view", False) or name in _FREE:
            return out
        if name == "_local_scalar_dense":
            self.host_reads += 1
            return out
        self.log.append(Launch(name, self._bytes(name, args, kwargs, out),
                               self._flops(func, name, args, kwargs, out)))
        return out

    @staticmethod
    def _bytes(name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any) -> int:
        outs = _tensors(out)
        if name in _GATHERS:
            index = [t for t in _tensors(args[1:]) + _tensors(kwargs)
                     if not t.is_floating_point()]
            return 2 * sum(_accessed_bytes(t) for t in outs) + sum(
                _accessed_bytes(t) for t in index)
        if name in _SCATTERS:
            dest = args[0]
            operands = _tensors(args[1:]) + _tensors(kwargs)
            values = sum(_accessed_bytes(t) for t in operands if t.dtype == dest.dtype)
            indices = sum(_accessed_bytes(t) for t in operands if t.dtype != dest.dtype)
            return 2 * values + indices
        seen: Dict[int, torch.Tensor] = {}
        for t in _tensors(args) + _tensors(kwargs) + outs:
            seen.setdefault(id(t), t)
        return sum(_accessed_bytes(t) for t in seen.values())

    @staticmethod
    def _flops(func: Any, name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any],
               out: Any) -> int:
        if name in _SDPA:
            return _sdpa_flops(args)
        packet = _INPLACE_GEMMS.get(name, func.overloadpacket)
        if packet in _FLOPS:
            shapes = [t.shape if isinstance(t, torch.Tensor) else t for t in args]
            try:
                return int(_FLOPS[packet](*shapes, out_shape=_out_shape(out), **{
                    k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}))
            except TypeError:
                return int(_FLOPS[packet](*shapes, **{
                    k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}))
        if name in _NO_ARITH or name in _FREE:
            return 0
        outs = _tensors(out) or _tensors(args[:1])
        return sum(t.numel() for t in outs)


#: In-place matrix products: the formula of their out-of-place op (``acc.baddbmm_(a, b)``).
_INPLACE_GEMMS = {"baddbmm_": _aten.baddbmm, "addmm_": _aten.addmm}
#: Fused attention ops torch's table lacks (the CPU flash kernel) or cannot count (grouped
#: query heads: fewer key heads than query heads).
_SDPA = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"}


def _sdpa_flops(args: Tuple[Any, ...]) -> int:
    """``Q K^T`` and ``P V`` of a fused attention, over every query head (``2 m n k`` each,
    the whole score matrix whatever the mask: what torch's own formula counts)."""
    q, k, v = args[:3]
    rows = q.numel() // q.shape[-1]
    return 2 * rows * k.shape[-2] * (q.shape[-1] + v.shape[-1])


def _out_shape(out: Any) -> Any:
    outs = _tensors(out)
    return outs[0].shape if outs else None


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """Public figures of a card for the modelled time: HBM bandwidth (bytes/s), peak
    half-precision matrix FLOP/s, and a stated host cost per launch (seconds)."""

    name: str
    bandwidth: float
    flops: float
    launch_s: float


#: BI-V100: 32 GB HBM2 at 1.2 TB/s, 147 TFLOPS fp16 (Iluvatar's public specification);
#: H200: 4.8 TB/s HBM3e, 989 TFLOPS dense fp16/bf16 (NVIDIA's).  Launch cost: 8 us on
#: BI-V100 (eager mode, within the 5-10 us of host time per launch), 5 us on an H200; both
#: are assumptions of the model, to be calibrated by ``vllm-bi100-patch selftest`` on the card.
DEVICES = {
    "bi-v100": DeviceModel("BI-V100", 1.2e12, 147e12, 8e-6),
    "h200": DeviceModel("H200", 4.8e12, 989e12, 5e-6),
}


def predict(account: Account, device: DeviceModel) -> float:
    """Modelled seconds for the account's launches on ``device`` (a model, not a
    measurement): per launch ``max(bytes / bandwidth, flops / peak) + launch cost``."""
    return sum(max(launch.bytes / device.bandwidth, launch.flops / device.flops)
               + device.launch_s for launch in account.log)
