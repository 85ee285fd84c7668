"""The decode route table: the one place the routing rules are written, and the one object that
applies them (``RouteTable``, one per ops profile and routing).

``RouteTable`` owns everything the choice of a route needs: the facts of a call (``Facts``:
head size, fp8, blocksparse, which kernels are usable, the occupancy rule, the longest
sequence), the entries that can apply with this profile and routing, the kernel rules, the choice
(``route``), why a kernel cannot take a call (``why_not``) and ``describe()`` (what ``doctor``
and ``status`` print), so an operator is never told a route the server does not take.  The
decoder (``decoder.py``) asks it for a route and calls the kernel; this module never sees the
decoder.

Two declarative tables:

- ``KERNEL_RULES``: when a present kernel cannot take a call (fp8 cache without scales,
  blocksparse without its parameters, V1 above its length limit, V2 with a block size that
  does not divide the partition size);
- ``ROUTES``: ordered entries of (condition, route, reason); the first entry whose condition
  holds gives the route.  Each entry also says, from what the table knows before any call (the
  probe and the routing settings), whether it can ever apply and in which words (``band``;
  None: never).

V1's length limit (``v1_limit``) and the BI-V100 occupancy rule (``use_v1``) are decided in
``limits.py`` only (re-exported here).  Facts and sources: ``docs/bi100-limits.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from ..kernels.cache import ceil_div
from .calls import DecodeCall
from .limits import (ILUVATAR_V1_MAX_SEQ_LEN, NATIVE_HEAD_SIZES, STOCK_V1_MAX_SEQ_LEN, Routing,
                     use_v1, v1_limit)
from .longest import longest, verify_bound
from .probe import KernelProfile, OpsProfile

__all__ = ["Facts", "ILUVATAR_V1_MAX_SEQ_LEN", "KERNEL_RULES", "NATIVE_HEAD_SIZES", "ROUTES",
           "RouteTable", "Routing", "STOCK_V1_MAX_SEQ_LEN", "use_v1", "v1_limit"]

def _label(kernel: KernelProfile) -> str:
    return "V1" if kernel.name.endswith("v1") else "V2"


@dataclasses.dataclass(frozen=True)
class KernelRule:
    """A present kernel that cannot take a call: ``applies`` (can this rule ever exclude
    ``kernel`` here), ``excludes`` (does it for this call), ``band`` (in words)."""

    name: str
    applies: Callable[["RouteTable", KernelProfile], bool]
    excludes: Callable[["RouteTable", "Facts"], bool]
    band: Callable[["RouteTable", KernelProfile], str]


KERNEL_RULES: Tuple[KernelRule, ...] = (
    KernelRule("fp8", lambda t, k: not (k.takes_scales and k.takes_kv_cache_dtype),
               lambda t, f: f.fp8,
               lambda t, k: f"fp8 KV cache: {_label(k)} takes no scales, so not {_label(k)}"),
    KernelRule("blocksparse", lambda t, k: not k.takes_blocksparse,
               lambda t, f: f.blocksparse,
               lambda t, k: f"blocksparse attention: {_label(k)} takes no blocksparse "
                            f"parameters, so not {_label(k)}"),
    KernelRule("v1_length", lambda t, k: _label(k) == "V1",
               lambda t, f: f.call.max_seq_len > t.v1_limit,
               lambda t, k: f"max_seq_len > {t.v1_limit}: not V1 (its logits would not fit "
                            "in shared memory)"),
    KernelRule("v2_partition", lambda t, k: _label(k) == "V2",
               lambda t, f: t.routing.partition_size % f.call.block_size != 0,
               lambda t, k: f"block sizes that do not divide the partition size "
                            f"{t.routing.partition_size}: not V2"),
)


@dataclasses.dataclass(frozen=True)
class Route:
    """One entry of the route table: ``when`` (does it apply to this call), ``route``, ``reason`` (why, for a
    fallback), ``band`` (whether it can ever apply with this table, and in which words)."""

    name: str
    route: str
    when: Callable[["RouteTable", "Facts"], bool]
    band: Callable[["RouteTable"], Optional[str]]
    reason: Callable[["RouteTable", "Facts"], str] = lambda t, f: ""


def _live(t: "RouteTable") -> bool:
    return t.profile is not None and t.routing.fallback_above != 0


def _present(t: "RouteTable", which: str) -> bool:
    return t.profile is not None and getattr(t.profile, which).present


def _both(t: "RouteTable") -> bool:
    return _live(t) and _present(t, "v1") and _present(t, "v2")


def _unusable(t: "RouteTable", f: "Facts") -> str:
    assert t.profile is not None
    return "; ".join(f"{_label(k)}: {t.why_not(k, f)}" for k in (t.profile.v1, t.profile.v2))


ROUTES: Tuple[Route, ...] = (
    Route("no_ops", "fallback", lambda t, f: True,
          lambda t: "every length: pure-PyTorch decode (no native ops)" if t.profile is None
          else None, lambda t, f: "no native ops"),
    Route("forced", "fallback", lambda t, f: True,
          lambda t: "every length: pure-PyTorch decode (fallback forced)"
          if t.profile is not None and t.routing.fallback_above == 0 else None,
          lambda t, f: "fallback_above=0"),
    Route("head_size", "fallback", lambda t, f: f.head_size not in NATIVE_HEAD_SIZES,
          lambda t: f"head sizes outside {list(NATIVE_HEAD_SIZES)}: pure-PyTorch decode"
          if _live(t) and (_present(t, "v1") or _present(t, "v2")) else None,
          lambda t, f: f"head size {f.head_size} has no native kernel"),
    Route("longest", "fallback", lambda t, f: f.longest_above(t.routing.fallback_above or 0),
          lambda t: f"longest sequence > {t.routing.fallback_above}: pure-PyTorch decode"
          if _live(t) and t.routing.fallback_above else None,
          lambda t, f: f"fallback_above={t.routing.fallback_above}"),
    Route("occupancy_v1", "native_v1",
          lambda t, f: f.usable("v1") and f.usable("v2") and f.occupancy_v1(),
          lambda t: f"max_seq_len <= {t.v1_limit}, V1 and V2 usable: native V1 where one "
                    f"partition ({t.routing.partition_size} tokens) covers it or num_seqs x "
                    f"num_heads fills the {t.routing.max_blocks} CTAs (occupancy rule)"
          if _both(t) else None),
    Route("occupancy_v2", "native_v2", lambda t, f: f.usable("v1") and f.usable("v2"),
          lambda t: f"max_seq_len <= {t.v1_limit}, V1 and V2 usable: native V2 otherwise "
                    "(occupancy rule)" if _both(t) else None),
    Route("v1", "native_v1", lambda t, f: f.usable("v1"),
          lambda t: None if not (_live(t) and _present(t, "v1")) else
          f"max_seq_len <= {t.v1_limit}: native V1" if not _present(t, "v2") else
          f"max_seq_len <= {t.v1_limit}, V2 not usable: native V1"),
    Route("v2", "native_v2", lambda t, f: f.usable("v2"),
          lambda t: None if not (_live(t) and _present(t, "v2")) else
          "every length: native V2 (no V1)" if not _present(t, "v1") else
          f"max_seq_len > {t.v1_limit} or V1 not usable: native V2"),
    Route("none_usable", "fallback", lambda t, f: True,
          lambda t: None if not _live(t) else
          f"max_seq_len > {t.v1_limit}: pure-PyTorch decode (no V2)"
          if _present(t, "v1") and not _present(t, "v2") else
          "every length: pure-PyTorch decode (no usable native kernel)"
          if not (_present(t, "v1") or _present(t, "v2")) else
          "neither kernel usable for the call: pure-PyTorch decode", _unusable),
)

#: The entries that choose between the kernels by length: listed first by ``describe``.
LENGTH_ROUTES = ("occupancy_v1", "occupancy_v2", "v1", "v2", "none_usable")


class Facts:
    """What the route table's entries ask about one call (computed on demand, at most once)."""

    __slots__ = ("table", "call", "known_longest", "head_size", "fp8", "blocksparse", "chosen",
                 "_usable")
    table: "RouteTable"
    call: DecodeCall
    #: The longest sequence where it is known without a device sync (``verify_bound``).
    known_longest: Optional[int]
    head_size: int
    fp8: bool
    blocksparse: bool
    chosen: Optional["Route"]  # the entry chosen on these facts (``RouteTable.route``)

    def __init__(self, table: "RouteTable", call: DecodeCall,
                 known_longest: Optional[int] = None) -> None:
        self.table, self.call, self.known_longest = table, call, known_longest
        self.head_size = int(call.query.shape[2])
        self.fp8 = call.kv_cache_dtype not in ("auto", None)
        self.blocksparse = call.is_blocksparse
        self.chosen = None
        self._usable: Dict[str, bool] = {}

    def reason(self) -> str:
        """Why the chosen entry falls back (empty for a native route)."""
        return self.chosen.reason(self.table, self) if self.chosen is not None else ""

    def reason_name(self) -> str:
        """Why the call took its route, as the metrics' ``reason`` (issue 23): the entry's name;
        for ``none_usable``, the rule that excluded the first present kernel (V1 first), or
        ``"kernel_absent"``."""
        chosen, profile = self.chosen, self.table.profile
        assert chosen is not None
        if chosen.name != "none_usable" or profile is None:
            return chosen.name
        for kernel in (profile.v1, profile.v2):
            if kernel.present:
                rule = self.table.excluded_by(kernel, self)
                if rule is not None:
                    return rule.name
        return "kernel_absent"

    def usable(self, which: str) -> bool:
        got = self._usable.get(which)
        if got is None:
            t = self.table
            assert t.profile is not None
            kernel = getattr(t.profile, which)
            got = self._usable[which] = kernel.present and t.excluded_by(kernel, self) is None
        return got

    def occupancy_v1(self) -> bool:
        q, t = self.call.query, self.table
        return use_v1(int(q.shape[0]), int(q.shape[1]), self.call.max_seq_len, t.routing,
                      t.v1_limit)

    def longest_above(self, threshold: int) -> bool:
        call = self.call
        return longest(call.seq_lens, call.max_seq_len, threshold, self.known_longest) > threshold


class RouteTable:
    """The routes of one ops profile (None: no native ops) under one routing: which entries can
    apply, the route of a call, why a kernel cannot take it, and ``describe()``."""

    profile: Optional[OpsProfile]

    def __init__(self, profile: Optional[OpsProfile],
                 routing: Union[Routing, Callable[[], Routing]]) -> None:
        self.profile = profile
        self._routing: Optional[Routing] = routing if isinstance(routing, Routing) else None
        self._make_routing = routing
        self._limit: Optional[int] = None
        self._applicable: Optional[List[Tuple[Route, str]]] = None
        self._rules: Dict[str, List[KernelRule]] = {}

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
            self._limit = v1_limit(self.routing, self.profile.build if self.profile else "stock")
        return self._limit

    def applicable(self) -> List[Tuple[Route, str]]:
        """The entries that can apply here, with their bands (recomputed when a kernel turns
        out to be absent)."""
        if self._applicable is None:
            self._applicable = [(entry, band) for entry in ROUTES for band in [entry.band(self)]
                                if band is not None]
            if self.profile is not None:
                self._rules = {k.name: [r for r in KERNEL_RULES if r.applies(self, k)]
                               for k in (self.profile.v1, self.profile.v2)}
        return self._applicable

    def excluded_by(self, kernel: KernelProfile, facts: Facts) -> Optional[KernelRule]:
        self.applicable()
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
        for entry, _ in self.applicable():
            if entry.when(self, facts):
                return entry
        raise AssertionError("the route table has no entry for this call")  # pragma: no cover

    def route(self, call: DecodeCall) -> Tuple[str, Optional[KernelProfile], Facts]:
        """The route ``call`` takes, its kernel (None: the pure-PyTorch decode), and the
        facts it was chosen on (``facts.chosen``: the table's entry).

        Raises:
            ValueError: ``max_seq_len`` below a sequence length known without a sync
                (``longest.verify_bound``).
        """
        facts = Facts(self, call, verify_bound(call.seq_lens, call.max_seq_len))
        chosen = facts.chosen = self.choose(facts)
        if chosen.route == "fallback":
            return chosen.route, None, facts
        assert self.profile is not None
        return chosen.route, self.profile.v1 if chosen.route == "native_v1" else self.profile.v2, facts

    def partitions(self, max_seq_len: int) -> int:
        """V2's partitions for a sequence bound of ``max_seq_len``."""
        return ceil_div(max_seq_len, self.routing.partition_size)

    def drop(self, kernel: KernelProfile, reason: str) -> None:
        """``kernel`` raised NotImplementedError when called: absent for the rest of the
        process (the entries are read again without it)."""
        assert self.profile is not None
        self.profile.mark_absent(kernel, reason)
        self._applicable = None

    def describe(self) -> Dict[str, Any]:
        """The probe and the route each case takes (``status``/``doctor``): the length entries
        first, then the cases that override them, then what each kernel cannot take."""
        bands = [b for r, b in self.applicable() if r.name in LENGTH_ROUTES]
        bands += [b for r, b in self.applicable() if r.name not in LENGTH_ROUTES]
        if self.profile is None:
            return {"native_ops": None, "v1_limit": None, "bands": bands}
        if self.routing.fallback_above != 0:
            bands += [rule.band(self, k) for k in (self.profile.v1, self.profile.v2)
                      if k.present for rule in self._rules[k.name]]
        return {"native_ops": self.profile.describe(), "v1_limit": self.v1_limit,
                "bands": bands}
