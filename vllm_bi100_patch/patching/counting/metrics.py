"""The shim's counters as Prometheus series: what is counted, and under which names.

Counting stays plain integers in the process that counts (a few increments per call, under
one lock); ``families()`` turns a snapshot of them into metric families, which
``export`` writes to prometheus_client's multiprocess files or serves from an
in-process collector.  Stdlib only, and cheap to import (the patch layer imports it):
prometheus_client is imported by ``export``, and only when it exports.

Two sources, read through one seam, ``snapshot()``:

- ``read_counts()``: the shim's counters by name, as ``status()["counts"]`` shows them: the
  one registry, ``counters.snapshot()`` (every counter a row of the table declares: calls of
  each patched method, block moves, fp8 writes, the engine rows' fixes, ...; then the decode
  routes).  A counter without a series of its own (``NAMED_COUNTS``) is exported generically
  as ``calls_total{counter="<name>"}``, so a row added to the table is on /metrics at once;
- ``TALLY``: what is counted for the metrics only: why each decode took its route and its
  ``max_seq_len`` (reported by the native decoder), prefix calls, tokens and float32 re-runs
  by path (reported by the prefix kernel through ``kernels.prefill.prefix.PrefixStats``), and calls
  refused with an error (counted where the registry installs a row's wrapper).

Names follow vLLM's (``vllm:`` and a colon) with the shim's own prefix ``vllm_bi100:``; the
README's table of series is generated from ``SERIES``.
"""

from __future__ import annotations

import bisect
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from . import counters
from .. import table

if TYPE_CHECKING:
    from ...attention.kernels.prefill.prefix import PrefixStats

PREFIX = "vllm_bi100:"
ROUTES = ("native_v1", "native_v2", "fallback")
#: Upper bounds of the ``max_seq_len`` histogram's buckets (then +Inf): the native V1 limits
#: that matter (8,192 on stock CUDA, 32,768 on BI-V100: docs/bi100-limits.md) and above.
BUCKETS: Tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
#: Paths of the prefix kernel (``PrefixStats``): a call whose sequences took both is "mixed".
PREFIX_PATHS = ("sdpa", "tiled")

#: The ``reason`` label of a decode call, from the route row (or kernel rule) that chose its
#: route (``native.routes``; ``Facts.reason_name``).  Every row and rule has one (tested).
REASONS: Dict[str, str] = {
    "occupancy_v1": "occupancy_rule", "occupancy_v2": "occupancy_rule",
    "v1": "only_kernel", "v2": "only_kernel",
    "no_ops": "no_native_ops", "forced": "fallback_forced", "head_size": "head_size",
    "longest": "fallback_above", "v1_length": "above_v1_limit", "fp8": "fp8_cache",
    "blocksparse": "blocksparse", "v2_partition": "block_size",
    "kernel_absent": "kernel_absent",
    "none_usable": "no_usable_kernel",  # reason_name names the rule instead; kept as a label
}

#: Counters of ``read_counts()`` with a series of their own: key -> (series, labels).
NAMED_COUNTS: Dict[str, Tuple[str, Tuple[Tuple[str, str], ...]]] = {
    "decode_native_v1": ("decode_calls", (("route", "native_v1"),)),
    "decode_native_v2": ("decode_calls", (("route", "native_v2"),)),
    "decode_fallback": ("decode_calls", (("route", "fallback"),)),
    "swap_blocks": ("block_moves", (("op", "swap"),)),
    "copy_blocks": ("block_moves", (("op", "copy"),)),
    "kv_write_fp8": ("fp8_cache_writes", ()),
    "dense_prefill": ("dense_prefill_calls", (("path", "pytorch"),)),
    "dense_vendor": ("dense_prefill_calls", (("path", "vendor"),)),
    "prefix_block_table": ("block_table_fixes", ()),
    "tool_arguments_invalid": ("tool_arguments_invalid", ()),
}
#: Counters already told by other series (decode calls by route, prefix calls by path).
TOLD_ELSEWHERE = ("forward_decode", "forward_prefix")
#: The counters the table's rows declare that have no series of their own: exported as
#: ``calls_total{counter=...}`` (so is any counter registered later).
GENERIC_COUNTS: Tuple[str, ...] = tuple(
    name for row in table.PATCHES for name in row.counters
    if name not in NAMED_COUNTS and name not in TOLD_ELSEWHERE)

#: (name without prefix, kind, labels, help): every series, in the README's order.
SERIES: Tuple[Tuple[str, str, str, str], ...] = (
    ("decode_calls", "counter", "route",
     "Patched PagedAttention.forward_decode calls by route: native_v1, native_v2, fallback "
     "(the pure-PyTorch decode)."),
    ("decode_route_reasons", "counter", "route, reason",
     "The same calls by the reason for their route: occupancy_rule, only_kernel (native); "
     + ", ".join(sorted(set(REASONS.values()) - {"occupancy_rule", "only_kernel"}))
     + " (fallback)."),
    ("decode_max_seq_len", "histogram", "route",
     "max_seq_len of each decode call (the batch's longest sequence, as vLLM passes it), by "
     "route; buckets " + ", ".join(str(b) for b in BUCKETS) + ", +Inf."),
    ("prefix_calls", "counter", "path",
     "Patched forward_prefix calls by path: sdpa, tiled, or mixed (sequences took both)."),
    ("prefix_tokens", "counter", "path", "New (query) tokens attended by forward_prefix, by path."),
    ("prefix_context_tokens", "counter", "path",
     "Cached context tokens read by forward_prefix, by path."),
    ("prefix_fp32_reruns", "counter", "",
     "Prefix sequences with rows past float16's range (scores or weighted sums), whose rows "
     "ran again in float32."),
    ("dense_prefill_calls", "counter", "path",
     "Prompt attention calls of the dense_prefill row: pytorch (head size above the vendor "
     "FwOp's limit) or vendor."),
    ("block_moves", "counter", "op", "KV block moves by the shim: swap or copy calls."),
    ("fp8_cache_writes", "counter", "", "fp8 KV-cache writes by the shim (kv_write row)."),
    ("block_table_fixes", "counter", "",
     "Prompt groups with a prefix-cache hit given their sequence's own block table "
     "(prefix_block_table row)."),
    ("tool_arguments_invalid", "counter", "",
     "Tool calls answered for a tool sent with strict: true whose arguments do not match its "
     "schema, and answers to tool_choice \"required\" that are no complete call array "
     "(chat_tool_calls row; one WARNING each, naming the request and tool)."),
    ("refused_calls", "counter", "row, error",
     "Patched calls that raised (a refused argument, a blocked kernel, ...), by row and "
     "exception type."),
    ("calls", "counter", "counter",
     "Every other counter of the shim, by its name in status()['counts'], from its first "
     "count: " + ", ".join(GENERIC_COUNTS) + " (the rows of the same names)."),
    ("info", "gauge", "shim_version, vllm_version, family, rows",
     "1 per configuration of the processes where a row applied: shim and vLLM versions, "
     "signature family, the rows applied (comma list)."),
)
HELP: Dict[str, str] = {name: text for name, _, _, text in SERIES}

Key = Tuple[str, ...]
Wrapper = Callable[[Callable[..., Any], Any, Tuple[Any, ...], Dict[str, Any]], Any]
Labels = Tuple[Tuple[str, str], ...]
#: One metric family: (name, kind, help, samples); a sample is (name, labels, value).  Histogram
#: buckets are per bucket (not cumulative) and without ``_count``, as multiprocess files hold them.
Family = Tuple[str, str, str, List[Tuple[str, Labels, float]]]


class Tally:
    """The counts kept for the metrics only: ``{key tuple: int}`` under one lock, except the
    per-call decode counts, kept in lists and updated without a lock (``decode``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Dict[Key, int] = {}
        #: reason -> [route, calls, calls per max_seq_len bucket (``BUCKETS``, then +Inf),
        #: sum of max_seq_len]: a reason (a route row or rule) belongs to one route.
        self._decode: Dict[str, List[Any]] = {}

    def decode(self, route: str, reason: str, max_seq_len: int) -> None:
        """One decode call (what ``decode_observer()`` does, as a method)."""
        self.decode_observer()(route, reason, max_seq_len)

    def decode_observer(self) -> Callable[[str, str, int], None]:
        """The native decoder's observer: per call one lookup and three list increments, no
        lock, no attribute lookups (everything it touches is bound here).

        vLLM runs a process's forward passes on one thread, so nothing else increments these
        at the same time; ``snapshot`` copies them in single C calls (atomic under the GIL)
        and may read one call's increments half done (the next flush catches up).  Two
        threads decoding at once in one process could lose an increment of these metrics,
        never corrupt one; the call counters of ``read_counts()`` keep their lock."""
        table, bounds, blank = self._decode, BUCKETS, [0] * (len(BUCKETS) + 2)

        def observe(route: str, reason: str, max_seq_len: int,
                    _bucket: Callable[..., int] = bisect.bisect_left) -> None:
            entry = table.get(reason)
            if entry is None:
                entry = table.setdefault(reason, [route, 0, *blank])
            entry[1] += 1
            entry[2 + _bucket(bounds, max_seq_len)] += 1
            entry[-1] += max_seq_len

        return observe

    def prefix(self, stats: "PrefixStats") -> None:
        """One prefix call, from what the kernel reported."""
        add: List[Tuple[Key, int]] = [(("prefix_calls", stats.path), 1)]
        for path in PREFIX_PATHS:
            add.append((("prefix_tokens", path), stats.tokens[path]))
            add.append((("prefix_context", path), stats.context[path]))
        add.append((("prefix_fp32_reruns",), stats.fp32_reruns))
        self._add(add)

    def refused(self, row: str, error: BaseException) -> None:
        """A patched call of ``row`` that raised ``error``."""
        self._add([(("refused", row, type(error).__name__), 1)])

    def _add(self, items: List[Tuple[Key, int]]) -> None:
        c = self._counts
        with self._lock:
            for key, n in items:
                c[key] = c.get(key, 0) + n

    def snapshot(self) -> Dict[Key, int]:
        """Every count as ``{key tuple: int}``: ``("reason", route, reason)``, ``("len",
        route, bucket index)``, ``("len_sum", route)`` and the keys of ``_counts``."""
        with self._lock:
            out = dict(self._counts)
        for reason, entry in list(self._decode.items()):  # list(): one C call
            route, calls, *lengths = list(entry)
            out[("reason", route, reason)] = calls
            for i, n in enumerate(lengths[:-1]):
                if n:
                    key = ("len", route, str(i))
                    out[key] = out.get(key, 0) + n
            out[("len_sum", route)] = out.get(("len_sum", route), 0) + lengths[-1]
        return out

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()
        self._decode.clear()

    def after_fork(self) -> None:
        """A fresh lock in a forked child (the parent's may have been held at the fork)."""
        self._lock = threading.Lock()


TALLY = Tally()


_OWN = "_vllm_bi100_counts_refusals"


def counts_own_refusals(wrapper: Wrapper) -> Wrapper:
    """Mark a hot wrapper that counts its refusals itself (``TALLY.refused`` in its own
    ``except``): the registry then adds no frame around it."""
    setattr(wrapper, _OWN, True)
    return wrapper


def count_refusals(row: str, wrapper: Wrapper) -> Wrapper:
    """``wrapper`` (a row's wrapt wrapper), counting the calls that raise through it into
    ``TALLY`` (``refused_calls``); the exception goes on unchanged.  A wrapper marked by
    ``counts_own_refusals`` is returned as it is."""
    if getattr(wrapper, _OWN, False):
        return wrapper
    refused = TALLY.refused

    def counted(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                kwargs: Dict[str, Any]) -> Any:
        try:
            return wrapper(wrapped, instance, args, kwargs)
        except Exception as exc:
            refused(row, exc)
            raise

    return counted


def read_counts() -> Dict[str, int]:
    """THE seam onto the shim's counters: ``{name: count}`` in this process, as
    ``status()["counts"]`` shows them (``counters.snapshot()``: empty before a patch module
    registered its counters)."""
    return counters.snapshot()


def snapshot() -> Dict[Key, int]:
    """Every count of this process: ``("count", name)`` from ``read_counts()``, the rest from
    ``TALLY``."""
    out: Dict[Key, int] = {("count", k): int(v) for k, v in read_counts().items()}
    out.update(TALLY.snapshot())
    return out


def since(counts: Dict[Key, int], base: Dict[Key, int]) -> Dict[Key, int]:
    """``counts`` minus ``base`` (the counts a forked child inherited)."""
    return {k: v - base.get(k, 0) for k, v in counts.items()} if base else dict(counts)


def families(counts: Dict[Key, int], info: Optional[Dict[str, str]]) -> List[Family]:
    """The metric families of ``counts`` (a ``snapshot()``, possibly ``since`` a base) and the
    info labels.  Fixed label sets are always present (zeros included), so rates and ratios
    exist from the start; reasons, refusals and other counters once they are non-zero."""
    out: Dict[str, Dict[Tuple[str, Labels], float]] = {}

    def sample(name: str, labels: Labels, value: float, suffix: str = "_total") -> None:
        acc = out.setdefault(name, {})
        key = (PREFIX + name + suffix, labels)
        acc[key] = acc.get(key, 0.0) + value

    get = counts.get
    for counter, (name, labels) in NAMED_COUNTS.items():
        sample(name, labels, get(("count", counter), 0))
    for route in ROUTES:
        for i in range(len(BUCKETS) + 1):
            le = str(float(BUCKETS[i])) if i < len(BUCKETS) else "+Inf"
            sample("decode_max_seq_len", (("route", route), ("le", le)),
                   get(("len", route, str(i)), 0), "_bucket")
        sample("decode_max_seq_len", (("route", route),), get(("len_sum", route), 0), "_sum")
    for path in PREFIX_PATHS + ("mixed",):
        sample("prefix_calls", (("path", path),), get(("prefix_calls", path), 0))
    for path in PREFIX_PATHS:
        sample("prefix_tokens", (("path", path),), get(("prefix_tokens", path), 0))
        sample("prefix_context_tokens", (("path", path),), get(("prefix_context", path), 0))
    sample("prefix_fp32_reruns", (), get(("prefix_fp32_reruns",), 0))
    for key, value in sorted(counts.items()):
        if not value:
            continue
        if key[0] == "reason":
            sample("decode_route_reasons", (("route", key[1]),
                                            ("reason", REASONS.get(key[2], key[2]))), value)
        elif key[0] == "refused":
            sample("refused_calls", (("row", key[1]), ("error", key[2])), value)
        elif key[0] == "prefix_calls" and key[1] not in PREFIX_PATHS + ("mixed",):
            sample("prefix_calls", (("path", key[1]),), value)
        elif key[0] == "count" and key[1] not in NAMED_COUNTS and key[1] not in TOLD_ELSEWHERE:
            sample("calls", (("counter", key[1]),), value)
    if info is not None:
        sample("info", tuple(sorted(info.items())), 1, "")
    kinds = {n: k for n, k, _, _ in SERIES}
    return [(PREFIX + name, kinds[name], HELP[name], [(s, lab, v) for (s, lab), v in acc.items()])
            for name, acc in out.items()]


def series_table() -> str:
    """The README's table of series (generated)."""
    rows = ["| series | type | labels | meaning |", "|---|---|---|---|"]
    for name, kind, labels, text in SERIES:
        shown = PREFIX + name + ("_total" if kind == "counter" else "")
        rows.append(f"| `{shown}` | {kind} | {labels or '–'} | {text} |")
    return "\n".join(rows)


def names() -> List[str]:
    """Every series name as /metrics shows it (histograms: their base name)."""
    return [PREFIX + n + ("_total" if k == "counter" else "") for n, k, _, _ in SERIES]
