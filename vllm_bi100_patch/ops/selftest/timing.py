"""Timing the kernels at the model's shape: decode per call, prefix per chunk, with their
account, inside a memory limit and a time limit.

- clock: medians of ``repeats`` calls after one warm-up; CUDA events on a GPU (each call
  between two events, synchronised once), ``time.perf_counter`` on CPU;
- account: every timed call is counted once more under ``account.Account`` (launches, bytes:
  the device-independent account of the benchmark), and the BI-V100 model calibrated on the
  card's published measurements gives its ``projected_ms`` (``calibrated``; None for a native
  kernel, which counts as one launch moving the minimal bytes: the cache it reads, the query
  and output);
- memory: a case whose cache plus the kernels' working set (``budget_mb``) exceeds
  ``memory_limit`` is not run (its row says why); on CUDA the peak is read back
  (``peak_mib``);
- time: a case that would start after ``deadline`` (``time.monotonic``) is not run.

Nothing here knows vLLM; ``native.NativeV1`` is handed in.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ...attention.kernels import paged_decode, paged_prefix
from .shape import Shape

__all__ = ["Plan", "Recorder", "cache_bytes", "decode_case", "median_ms", "prefix_case"]

MiB = 1 << 20


@dataclasses.dataclass
class Plan:
    """What to time: decode lengths, prefix contexts (each with one ``chunk`` of new tokens),
    repeats per case, the kernels' working set per call, the memory and time limits."""

    decode_lengths: Sequence[int]
    prefix_contexts: Sequence[int]
    chunk: int
    repeats: int
    budget_mb: int
    memory_limit: int  # bytes
    deadline: float  # time.monotonic()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls, after one warm-up."""
    fn()
    _sync(device)
    if device.type == "cuda":
        pairs = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize(device)
        return statistics.median(s.elapsed_time(e) for s, e in pairs)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _dtype(shape: Shape) -> torch.dtype:
    return getattr(torch, shape.dtype)


def cache_bytes(shape: Shape, tokens: int) -> int:
    """Bytes of the K and V cache blocks holding ``tokens`` tokens (one layer, one rank)."""
    blocks = max(1, math.ceil(tokens / shape.block_size))
    size = torch.empty((), dtype=_dtype(shape)).element_size()
    return blocks * shape.block_size * shape.kv_bytes_per_token(size)


def _cache(shape: Shape, tokens: int, device: torch.device, gen: torch.Generator):
    dtype = _dtype(shape)
    blocks = max(1, math.ceil(tokens / shape.block_size))
    x = 16 // torch.empty((), dtype=dtype).element_size()
    kv, d, bs = shape.kv_heads, shape.head_size, shape.block_size
    kc = torch.randn(blocks, kv, d // x, bs, x, generator=gen, device=device, dtype=dtype)
    vc = torch.randn(blocks, kv, d, bs, generator=gen, device=device, dtype=dtype)
    bt = torch.arange(blocks, dtype=torch.int32, device=device).view(1, blocks)
    return kc, vc, bt


def decode_case(shape: Shape, tokens: int, device: torch.device, seed: int = 0):
    """One sequence of ``tokens`` cached tokens: ``(query, key_cache, value_cache,
    block_tables, seq_lens)`` in vLLM's layout, random, on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    kc, vc, bt = _cache(shape, tokens, device, gen)
    q = torch.randn(1, shape.heads, shape.head_size, generator=gen, device=device,
                    dtype=_dtype(shape))
    return q, kc, vc, bt, torch.tensor([tokens], dtype=torch.int32, device=device)


def prefix_case(shape: Shape, context: int, chunk: int, device: torch.device, seed: int = 0):
    """One chunk of ``chunk`` new tokens after ``context`` cached ones: ``paged_prefix``'s
    positional arguments, random, on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    kc, vc, bt = _cache(shape, context + chunk, device, gen)
    dtype = _dtype(shape)

    def draw(heads: int) -> torch.Tensor:
        return torch.randn(chunk, heads, shape.head_size, generator=gen, device=device,
                           dtype=dtype)

    def ints(values: List[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return (draw(shape.heads), draw(shape.kv_heads), draw(shape.kv_heads), kc, vc, bt,
            ints([0, chunk]), ints([context + chunk]), ints([context]))


def _account(fn: Callable[[], Any]) -> Dict[str, Any]:
    """The call's account, and the calibrated BI-V100 model's time for it (``projected_ms``:
    ``calibrated.load()``, the constants that ship with the package)."""
    try:
        from .account import Account
    except ImportError:  # pragma: no cover - a torch without the dispatch-mode API
        return {"launches": None, "bytes": None, "host_reads": None, "projected_ms": None}
    from . import calibrated

    with Account() as acc:
        fn()
    return {"launches": acc.launches, "bytes": acc.bytes, "host_reads": acc.host_reads,
            "projected_ms": calibrated.load().predict(acc.log) * 1e3}


class Recorder:
    """Runs the plan's cases one by one (``decode``, ``prefix``) and keeps their timings."""

    def __init__(self, shape: Shape, device: torch.device, plan: Plan,
                 progress: Callable[[str], None]) -> None:
        self.shape, self.device, self.plan, self.progress = shape, device, plan, progress
        self.timings: List[Dict[str, Any]] = []
        self.skipped: List[Dict[str, Any]] = []
        self.scale = shape.head_size ** -0.5

    def _fits(self, kernel: str, route: str, tokens: int, extra: int = 0) -> bool:
        need = cache_bytes(self.shape, tokens) + extra + self.plan.budget_mb * MiB
        why = None
        if need > self.plan.memory_limit:
            why = (f"needs {need / MiB:,.0f} MiB (cache + {self.plan.budget_mb} MiB working "
                   f"set) > the memory limit {self.plan.memory_limit / MiB:,.0f} MiB")
        elif time.monotonic() > self.plan.deadline:
            why = "time limit reached"
        if why is not None:
            self.skipped.append({"kernel": kernel, "route": route, "tokens": tokens, "why": why})
            self.progress(f"skip {kernel} {route} {tokens:,} tokens: {why}")
        return why is None

    def _time(self, kernel: str, route: str, tokens: int, fn: Callable[[], Any],
              account: Optional[Dict[str, Any]] = None, **extra: Any) -> None:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        ms = median_ms(fn, self.device, self.plan.repeats)
        acc = account if account is not None else _account(fn)
        timing: Dict[str, Any] = {"kernel": kernel, "route": route, "tokens": tokens, "ms": ms,
                                  **acc, "account": "minimal" if account is not None
                                  else "counted", **extra}
        if acc.get("bytes"):
            timing["gb_per_s"] = acc["bytes"] / (ms * 1e-3) / 1e9  # type: ignore[operator]
        if cuda:
            timing["peak_mib"] = torch.cuda.max_memory_allocated(self.device) / MiB
        self.timings.append(timing)
        self.progress(f"{kernel} {route} {tokens:,} tokens: {ms:.3f} ms")

    def decode(self, tokens: int, v1: Any = None) -> None:
        """The fallback decode at ``tokens`` (and native V1 when handed in and within its
        limit: above it V1 is never called)."""
        if not self._fits("decode", "fallback", tokens):
            return
        q, kc, vc, bt, sl = decode_case(self.shape, tokens, self.device)
        self._time("decode", "fallback", tokens, lambda: paged_decode(
            q, kc, vc, bt, sl, self.scale, max_seq_len=tokens, budget_mb=self.plan.budget_mb))
        if v1 is not None and tokens <= v1.limit:
            minimal = {"launches": 1, "host_reads": 0, "projected_ms": None, "bytes": cache_bytes(
                self.shape, tokens) + 2 * q.numel() * q.element_size()}
            self._time("decode", "native_v1", tokens,
                       lambda: v1.call(q, kc, vc, bt, sl, tokens, self.scale), minimal)

    def prefix(self, context: int) -> None:
        """The pure-PyTorch prefix over one chunk after ``context`` cached tokens."""
        chunk = self.plan.chunk
        extra = 3 * chunk * self.shape.heads * self.shape.head_size * 4
        if not self._fits("prefix", "fallback", context + chunk, extra):
            return
        args = prefix_case(self.shape, context, chunk, self.device)
        self._time("prefix", "fallback", context + chunk,
                   lambda: paged_prefix(*args, scale=self.scale, budget_mb=self.plan.budget_mb),
                   context=context, chunk=chunk)

    def run(self, v1: Any = None) -> List[Dict[str, Any]]:
        for tokens in self.plan.decode_lengths:
            self.decode(tokens, v1)
        for context in self.plan.prefix_contexts:
            self.prefix(context)
        return self.timings
