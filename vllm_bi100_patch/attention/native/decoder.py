"""``NativeDecoder``: native ``paged_attention_v1/v2`` or the pure-PyTorch fallback.

One per (ops module, routing settings), built by ``native.build`` with its route table (the
patch layer builds it at patch time), keeping a reference to the ops object.  Per call it takes
a ``calls.DecodeCall``, asks its route table for the route (``RouteSource``: the table also
checks that ``max_seq_len`` bounds the sequences where that is free), calls the kernel through
its convention's call function (``calls.py``), and counts the route.  ``describe()`` is the
route table's.  This module never imports the route table's module (``routes.py``), nor the
reverse: ``RouteSource`` says what the decoder asks of it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Protocol, Tuple

import torch

from ...patching.counting import counters, metrics
from ..kernels import DEFAULT_BUDGET_MB, paged_decode
from .calls import DecodeCall, call_unreadable
from .probe import KernelProfile, OpsProfile
from .scratch import Scratch

__all__ = ["CallFacts", "NativeDecoder", "RouteSource", "reset_route_counts", "route_counts", "scratch_bytes"]

#: How many decode calls took each route, in this process (``status()`` reports them as
#: ``decode_<route>``; ``counters.snapshot()`` holds them with every other counter).
_ROUTES = {route: counters.register("decode_" + route, "routes") for route in metrics.ROUTES}
#: The V2 scratch of this process (grow-only; shared by every decoder).
SCRATCH = Scratch()
#: (device, num_heads, num_kv_heads) -> the head_mapping built for a vendor kernel.
_mappings: Dict[Tuple[str, int, int], torch.Tensor] = {}


def route_counts() -> Dict[str, int]:
    """A consistent copy of the route counters."""
    return {name[len("decode_"):]: n for name, n in counters.snapshot("routes").items()}


def reset_route_counts() -> None:
    counters.reset("routes")


def _count_route(route: str) -> None:
    _ROUTES[route].add()


def scratch_bytes() -> int:
    """Bytes held by the V2 scratch buffers (including ones kept for captured graphs)."""
    return SCRATCH.nbytes()


class CallFacts(Protocol):
    """What the decoder reads of the facts a route was chosen on (``routes.Facts``)."""

    blocksparse: bool

    def reason(self) -> str:
        """Why the chosen route falls back."""

    def reason_name(self) -> str:
        """The name of why the call took its route (metrics, issue 23): the chosen route's name,
        or for the route where no kernel is usable, the kernel rule that excluded one."""


class RouteSource(Protocol):
    """What the decoder asks of its route table (``routes.RouteTable``)."""

    profile: Optional[OpsProfile]

    def route(self, call: DecodeCall) -> Tuple[str, Optional[KernelProfile], CallFacts]:
        """The route of ``call``, its kernel (None: the pure-PyTorch decode) and its facts."""

    def drop(self, kernel: KernelProfile, reason: str) -> None:
        """``kernel`` raised NotImplementedError: route around it from now on."""

    def partitions(self, max_seq_len: int) -> int:
        """V2's partitions for a sequence bound of ``max_seq_len``."""

    def describe(self) -> Dict[str, Any]:
        """The probe and the route each case takes."""


class NativeDecoder:
    """The native decode of one ops object (None: no native ops) through its route table."""

    #: Metrics (issue 23): called once per counted decode with ``(route, reason name,
    #: max_seq_len)`` (``CallFacts.reason_name``); set by the patch layer, which counts what
    #: the decoder reports (the decoder imports no metrics).  None: nothing is reported.
    observer: Optional[Callable[[str, str, int], None]] = None

    def __init__(self, ops: Any, routes: RouteSource, budget_mb: int = DEFAULT_BUDGET_MB) -> None:
        self.ops = ops
        self.routes = routes
        self.budget_mb = budget_mb  # the fallback's working set per call

    @property
    def profile(self) -> Optional[OpsProfile]:
        """The probe of ``ops`` (None: no native ops), as the route table holds it."""
        return self.routes.profile

    def describe(self) -> Dict[str, Any]:
        """The probe and the route each case takes (``RouteTable.describe``)."""
        return self.routes.describe()

    # --- a call --------------------------------------------------------------------------

    def decode(self, call: DecodeCall) -> torch.Tensor:
        """``[num_seqs, num_heads, head_size]`` attention of ``call``.

        Raises:
            ValueError: ``max_seq_len`` below a sequence length known without a sync.
            NotImplementedError: blocksparse attention that would have to fall back.
        """
        route, kernel, facts = self.routes.route(call)
        while kernel is not None:
            out = torch.empty_like(call.query)
            if self._run(kernel, call, out, route == "native_v2"):
                _count_route(route)
                observer = self.observer
                if observer is not None:  # metrics (issue 23)
                    observer(route, facts.reason_name(), call.max_seq_len)
                return out
            route, kernel, facts = self.routes.route(call)  # that kernel was a stub, now absent
        if facts.blocksparse:
            raise NotImplementedError(
                f"blocksparse paged attention (blocksparse_vert_stride={call.blocksparse[1]}) "
                "is only available in the native kernels, but this call would fall back "
                f"({facts.reason()}); the pure-PyTorch decode does not implement block "
                "sparsity")
        _count_route("fallback")
        observer = self.observer
        if observer is not None:  # metrics (issue 23)
            observer("fallback", facts.reason_name(), call.max_seq_len)
        return paged_decode(call.query, call.key_cache, call.value_cache, call.block_tables,
                            call.seq_lens, call.scale, alibi_slopes=call.alibi_slopes,
                            kv_cache_dtype=call.kv_cache_dtype, k_scale=call.k_scale,
                            v_scale=call.v_scale, max_seq_len=call.max_seq_len,
                            budget_mb=self.budget_mb)

    def _run(self, kernel: KernelProfile, call: DecodeCall, out: torch.Tensor,
             v2: bool) -> bool:
        """Call ``kernel``; False (and the kernel marked absent for the rest of the process)
        when it raises NotImplementedError: nothing was computed, the caller re-routes."""
        scratch = None
        if v2:
            q = call.query
            scratch = SCRATCH.get(int(q.shape[0]), int(q.shape[1]),
                                  self.routes.partitions(call.max_seq_len), int(q.shape[2]),
                                  out.dtype, out.device)
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
            self.routes.drop(kernel, "raised NotImplementedError when called "
                                     f"({exc or 'no message'})")
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
