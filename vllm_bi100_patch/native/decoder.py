"""``NativeDecoder``: native ``paged_attention_v1/v2`` or the pure-PyTorch fallback.

Built once per (ops module, routing settings) by the patch layer, keeping a reference to the
ops object.  Per call it takes a ``calls.DecodeCall``, checks that ``max_seq_len`` bounds the
sequences where that is free, picks the first row of ``routes.ROUTES`` that applies, calls
the kernel through its convention's call function (``calls.py``), and counts the route.
``describe()`` reads the same rows.  The actual longest sequence is read only when it is free
(CPU tensors) or needed (``fallback_above``, eager mode, ``max_seq_len`` above the threshold),
once per ``seq_lens`` tensor version, and never during CUDA-graph capture.
"""

from __future__ import annotations

import sys
import threading
import types
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from ..kernels import paged_decode
from ..kernels._common import ceil_div
from .calls import DecodeCall, call_unreadable
from .probe import KernelProfile, OpsProfile, compiled_kernels_missing
from .routes import KERNEL_RULES, LENGTH_ROUTES, ROUTES, KernelRule, Route, Routing, use_v1
from .routes import v1_limit as _v1_limit
from .scratch import Scratch, capturing

__all__ = ["NativeDecoder", "reset_route_counts", "route_counts", "scratch_bytes"]

#: How many decode calls took each route, in this process (``status()`` reports them).
ROUTE_COUNTS: Dict[str, int] = {"native_v1": 0, "native_v2": 0, "fallback": 0}
_counts_lock = threading.Lock()
#: The V2 scratch of this process (grow-only; shared by every decoder).
SCRATCH = Scratch()
#: (device, num_heads, num_kv_heads) -> the head_mapping built for a vendor kernel.
_mappings: Dict[Tuple[str, int, int], torch.Tensor] = {}
#: The longest sequence read for the last ``seq_lens`` tensor (its identity and version).
_longest_cache: Dict[str, Any] = {"ref": None, "version": -1, "value": 0}


def route_counts() -> Dict[str, int]:
    """A consistent copy of the route counters."""
    with _counts_lock:
        return dict(ROUTE_COUNTS)


def reset_route_counts() -> None:
    with _counts_lock:
        for key in ROUTE_COUNTS:
            ROUTE_COUNTS[key] = 0


def _count_route(route: str) -> None:
    with _counts_lock:
        ROUTE_COUNTS[route] += 1


def scratch_bytes() -> int:
    """Bytes held by the V2 scratch buffers (including ones kept for captured graphs)."""
    return SCRATCH.nbytes()


class Facts:
    """What the route rows ask about one call (computed on demand, at most once)."""

    __slots__ = ("decoder", "call", "head_size", "fp8", "blocksparse", "_usable")
    decoder: "NativeDecoder"
    call: DecodeCall
    head_size: int
    fp8: bool
    blocksparse: bool

    def __init__(self, decoder: "NativeDecoder", call: DecodeCall) -> None:
        self.decoder, self.call = decoder, call
        self.head_size = int(call.query.shape[2])
        self.fp8 = call.kv_cache_dtype not in ("auto", None)
        self.blocksparse = call.is_blocksparse
        self._usable: Dict[str, bool] = {}

    def usable(self, which: str) -> bool:
        got = self._usable.get(which)
        if got is None:
            d = self.decoder
            assert d.profile is not None
            kernel = getattr(d.profile, which)
            got = self._usable[which] = kernel.present and d.excluded_by(kernel, self) is None
        return got

    def occupancy_v1(self) -> bool:
        q, d = self.call.query, self.decoder
        return use_v1(int(q.shape[0]), int(q.shape[1]), self.call.max_seq_len, d.routing,
                      d.v1_limit)

    def longest_above(self, threshold: int) -> bool:
        return _longest(self.call.seq_lens, self.call.max_seq_len, threshold) > threshold


class NativeDecoder:
    """The native decode of one ops object (None: no native ops) under one routing."""

    profile: Optional[OpsProfile]
    #: Metrics (issue 23): called once per counted decode with ``(route, reason,
    #: max_seq_len)``, ``reason`` the route row's name (``reason_of``); set by the patch
    #: layer, which counts what the decoder reports (the decoder imports no metrics).
    observer: Optional[Callable[[str, str, int], None]] = None

    def __init__(self, ops: Any, routing: Union[Routing, Callable[[], Routing]]) -> None:
        self.ops = ops
        self.profile = OpsProfile(ops) if ops is not None else None
        self._routing: Optional[Routing] = routing if isinstance(routing, Routing) else None
        self._make_routing = routing
        self._limit: Optional[int] = None
        self._rows: Optional[List[Tuple[Route, str]]] = None
        self._rules: Dict[str, List[KernelRule]] = {}

    @classmethod
    def for_module(cls, module: types.ModuleType,
                   routing: Union[Routing, Callable[[], Routing]],
                   ixformer: bool) -> "NativeDecoder":
        """The decoder for the ops a vLLM attention module calls (its ``ops``, else
        ``vllm._custom_ops`` if imported); no native ops where those have no compiled
        kernels behind them (``probe.compiled_kernels_missing``)."""
        ops = vars(module).get("ops")
        if ops is None:
            ops = sys.modules.get("vllm._custom_ops")
        if ops is not None and compiled_kernels_missing(ops, ixformer) is not None:
            ops = None
        return cls(ops, routing)

    @property
    def routing(self) -> Routing:
        """The routing, built on first use (in the process that decodes: a device query in
        vLLM's front end before it forks workers would break CUDA in the children)."""
        if self._routing is None:
            assert callable(self._make_routing)
            self._routing = self._make_routing()  # type: ignore[assignment]
        assert self._routing is not None
        return self._routing

    @property
    def v1_limit(self) -> int:
        if self._limit is None:
            self._limit = _v1_limit(self.routing,
                                    self.profile.convention if self.profile else "stock")
        return self._limit

    # --- the table, as it applies to this decoder ------------------------------------------

    def rows(self) -> List[Tuple[Route, str]]:
        """The rows that can apply here, with their bands (recomputed when a kernel turns
        out to be absent)."""
        if self._rows is None:
            self._rows = [(row, band) for row in ROUTES for band in [row.band(self)]
                          if band is not None]
            if self.profile is not None:
                self._rules = {k.name: [r for r in KERNEL_RULES if r.applies(self, k)]
                               for k in (self.profile.v1, self.profile.v2)}
        return self._rows

    def excluded_by(self, kernel: KernelProfile, facts: Facts) -> Optional[KernelRule]:
        self.rows()
        for rule in self._rules.get(kernel.name, ()):
            if rule.excludes(self, facts):
                return rule
        return None

    def why_not(self, kernel: KernelProfile, facts: Facts) -> str:
        if not kernel.present:
            return kernel.describe()
        rule = self.excluded_by(kernel, facts)
        return rule.band(self, kernel) if rule is not None else "usable"

    def choose(self, facts: Facts) -> Route:
        for row, _ in self.rows():
            if row.when(self, facts):
                return row
        raise AssertionError("the route table has no row for this call")  # pragma: no cover

    def describe(self) -> Dict[str, Any]:
        """The probe and the route each case takes (``status``/``doctor``): the length rows
        first, then the cases that override them, then what each kernel cannot take."""
        bands = [b for r, b in self.rows() if r.name in LENGTH_ROUTES]
        bands += [b for r, b in self.rows() if r.name not in LENGTH_ROUTES]
        if self.profile is None:
            return {"native_ops": None, "v1_limit": None, "bands": bands}
        if self.routing.fallback_above != 0:
            bands += [rule.band(self, k) for k in (self.profile.v1, self.profile.v2)
                      if k.present for rule in self._rules[k.name]]
        return {"native_ops": self.profile.describe(), "v1_limit": self.v1_limit,
                "bands": bands}

    def reason_of(self, row: Route, facts: Facts) -> str:
        """Metrics (issue 23): the name of why a call took ``row``'s route: the row's name,
        or, for the row where neither kernel is usable, the kernel rule that excluded the
        first present kernel (V1 first), or ``"kernel_absent"`` when neither is present."""
        if row.name != "none_usable" or self.profile is None:
            return row.name
        for kernel in (self.profile.v1, self.profile.v2):
            if kernel.present:
                rule = self.excluded_by(kernel, facts)
                if rule is not None:
                    return rule.name
        return "kernel_absent"

    # --- a call --------------------------------------------------------------------------

    def decode(self, call: DecodeCall) -> torch.Tensor:
        """``[num_seqs, num_heads, head_size]`` attention of ``call``.

        Raises:
            ValueError: ``max_seq_len`` below a sequence length known without a sync.
            NotImplementedError: blocksparse attention that would have to fall back.
        """
        verify_bound(call.seq_lens, call.max_seq_len)
        facts = Facts(self, call)
        row = self.choose(facts)
        while row.route != "fallback":
            assert self.profile is not None
            kernel = self.profile.kernel(row.route)
            out = torch.empty_like(call.query)
            if self._run(kernel, call, out, row.route == "native_v2"):
                _count_route(row.route)
                observer = self.observer
                if observer is not None:  # metrics (issue 23)
                    observer(row.route, row.name, call.max_seq_len)
                return out
            facts = Facts(self, call)  # the kernel was a stub, now absent: choose again
            row = self.choose(facts)
        if facts.blocksparse:
            raise NotImplementedError(
                f"blocksparse paged attention (blocksparse_vert_stride={call.blocksparse[1]}) "
                "is only available in the native kernels, but this call would fall back "
                f"({row.reason(self, facts)}); the pure-PyTorch decode does not implement "
                "block sparsity")
        _count_route("fallback")
        if self.observer is not None:  # metrics (issue 23)
            self.observer("fallback", self.reason_of(row, facts), call.max_seq_len)
        return paged_decode(call.query, call.key_cache, call.value_cache, call.block_tables,
                            call.seq_lens, call.scale, alibi_slopes=call.alibi_slopes,
                            kv_cache_dtype=call.kv_cache_dtype, k_scale=call.k_scale,
                            v_scale=call.v_scale, max_seq_len=call.max_seq_len)

    def _run(self, kernel: KernelProfile, call: DecodeCall, out: torch.Tensor,
             v2: bool) -> bool:
        """Call ``kernel``; False (and the kernel marked absent for the rest of the process)
        when it raises NotImplementedError: nothing was computed, the caller re-routes."""
        scratch = None
        if v2:
            q = call.query
            scratch = SCRATCH.get(int(q.shape[0]), int(q.shape[1]),
                                  ceil_div(call.max_seq_len, self.routing.partition_size),
                                  int(q.shape[2]), out.dtype, out.device)
        assert kernel.func is not None
        try:
            if kernel.convention is None:
                call_unreadable(kernel.func, call, out, scratch)
            else:
                # Only vendor kernels take head_mapping (and only vendor builds, always eager,
                # run them): never built for a stock kernel, so never during graph capture.
                mapping = head_mapping_for(call) if kernel.takes_head_mapping else None
                kernel.convention.invoke(kernel.func, kernel.nargs, call, out, scratch, mapping)
        except NotImplementedError as exc:
            assert self.profile is not None
            self.profile.mark_absent(kernel, "raised NotImplementedError when called "
                                             f"({exc or 'no message'})")
            self._rows = None
            return False
        return True


def head_mapping_for(call: DecodeCall) -> torch.Tensor:
    """The int32 ``head_mapping`` a vendor kernel takes: the one vLLM passed (an int64 one
    converted on its device: no host read), or ``repeat_interleave(arange(num_kv_heads),
    num_heads // num_kv_heads)`` built on the query's device (once per device and shape)."""
    if call.head_mapping is not None:
        mapping = call.head_mapping
        return mapping if mapping.dtype == torch.int32 else mapping.to(torch.int32)
    device, num_heads, kv = call.query.device, int(call.query.shape[1]), call.num_kv_heads
    key = (str(device), num_heads, kv)
    built = _mappings.get(key)
    if built is None:
        built = torch.arange(kv, dtype=torch.int32, device=device).repeat_interleave(
            num_heads // kv)  # built on the device: no host-to-device copy
        _mappings[key] = built
    return built


# --- the actual longest sequence, without syncs that matter -------------------------------


def verify_bound(seq_lens: torch.Tensor, max_seq_len: int) -> None:
    """``max_seq_len`` must bound every sequence: it alone decides whether V1 may run (V1
    sizes its shared memory from it; a longer sequence overruns it and hangs BI-V100).

    Checked where it is free: CPU ``seq_lens`` (read once per tensor version), or a device
    ``seq_lens`` whose longest value this step already read (``fallback_above``).  Otherwise
    it is trusted, as vLLM computes it from the same lengths on the host
    (docs/bi100-limits.md, "max_seq_len"): reading a device tensor here would be a host sync
    per step, and impossible during CUDA-graph capture."""
    longest = _known_longest(seq_lens)
    if longest is not None and longest > max_seq_len:
        raise ValueError(f"max_seq_len={max_seq_len} is below the longest sequence in "
                         f"seq_lens ({longest}): it must bound every sequence (V1 sizes its "
                         "shared memory from it)")


def _read_longest(seq_lens: torch.Tensor) -> int:
    """The one device synchronisation of the routing (tests replace it to count calls)."""
    return int(seq_lens.max().item()) if seq_lens.numel() else 0


def _known_longest(seq_lens: torch.Tensor) -> Optional[int]:
    """The longest sequence when it costs no device sync: read from CPU ``seq_lens`` (once
    per tensor version), or the value already read for this device tensor's version."""
    ref = _longest_cache["ref"]
    if ref is not None and ref() is seq_lens and _longest_cache["version"] == seq_lens._version:
        return int(_longest_cache["value"])
    if seq_lens.device.type != "cpu":
        return None
    value = int(seq_lens.max()) if seq_lens.numel() else 0
    _longest_cache.update(ref=weakref.ref(seq_lens), version=seq_lens._version, value=value)
    return value


def _longest(seq_lens: torch.Tensor, max_seq_len: int, threshold: int) -> int:
    """Longest sequence for the ``fallback_above`` test, or ``max_seq_len`` as its bound:
    no read when the bound is within the threshold, none during capture, else one sync per
    ``seq_lens`` version, shared by all layers of a step."""
    if max_seq_len <= threshold:
        return max_seq_len
    known = _known_longest(seq_lens)
    if known is not None:
        return known
    if capturing():
        return max_seq_len
    value = _read_longest(seq_lens)
    _longest_cache.update(ref=weakref.ref(seq_lens), version=seq_lens._version, value=value)
    return value
