"""Same bits need the same calls (issue 26 item 1), proven without relying on a machine.

A BLAS (MKL, oneDNN, cuBLAS) chooses its kernel, its blocking and the split of the reduction
over threads from the whole shape of a call and the thread count, so a row's result is
the same in two slicings only if every matrix product that touches it is the same call; so
does a softmax (its reduction over a row is configured by the row's length and the number of
rows).  These tests record every matrix product, softmax and attention call the prefix and
dense kernels make (``Recorder``: op, and for each tensor operand its shape, strides, dtype,
data-pointer alignment and the byte offset in its buffer modulo 256, plus the scalar
arguments: what a library sees is a pointer, its alignment and the strides, never the
offset itself), attribute each to the query tile and key range it computes (the kernels'
``TRACE`` hooks), and assert that every tile saw exactly the same calls in every slicing: the
whole prompt, chunked prefill at several sizes, prefix-cache hits, a hit ending inside a
block.  No output is compared here, so the test holds or fails the same on every CPU and
thread count.  (The one other reduction, the re-run check's sum over a wave of tiles, only
decides whether a row is finite, which no summation order changes.)

Decode (batch invariance, issue 34 item 2): on the device path every matrix product and
every inexact reduction (the per-tile sums) has one signature, batch dimension included,
whatever the batch mates, the memory budget's passes and the block table's width (products
over a fixed chunk of tiles, the last one padded); the other reductions are exact (the
maximum; the query's L1 norm in float64, exact for float16 queries).  On the CPU path each
batch element's matrix is the same alone and with batch mates.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Dict, List, Optional

import pytest
import torch
from helpers.reference import cpu_half_gemm, make_cache
from helpers.slicing import chunked, dense_rows, hit, prefix_rows, prompt
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_bi100_patch.attention.kernels import decode, paged_decode
from vllm_bi100_patch.attention.kernels.cache import check_cache
from vllm_bi100_patch.attention.kernels.prefill import _sdpa as _prefix_sdpa
from vllm_bi100_patch.attention.kernels.prefill import _scores

_PRODUCTS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "addbmm", "dot", "mv"}


def _is_product(name: str) -> bool:
    return (name.rstrip("_") in _PRODUCTS or "scaled_dot_product" in name
            or "attention" in name or "softmax" in name)


def _operand(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        offset = x.storage_offset() * x.element_size() % 256
        return (tuple(x.shape), x.stride(), x.dtype, offset, x.data_ptr() % 64)
    if isinstance(x, (list, tuple)):
        return tuple(_operand(y) for y in x)
    return x


class Recorder(TorchDispatchMode):
    """Every product/attention call, under the key of the last ``TRACE`` event."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Dict[tuple, List[tuple]] = defaultdict(list)
        self.key: Optional[tuple] = None
        self.unattributed: List[str] = []

    def trace(self, key: tuple) -> None:
        self.key = key

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if _is_product(name):
            sig = (name, _operand(args), tuple(sorted((k, _operand(v)) for k, v in kwargs.items())))
            if self.key is None:
                self.unattributed.append(name)
            else:
                self.calls[self.key].append(sig)
        return func(*args, **kwargs)


def _recorded(monkeypatch, fn) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(_scores, "TRACE", rec.trace)
    monkeypatch.setattr(_prefix_sdpa, "TRACE", rec.trace)
    with rec:
        fn()
    assert not rec.unattributed, rec.unattributed
    assert rec.calls
    return rec


SETUPS = {"cpu-default": ("fp32", None, None), "cpu-tiled": ("fp32", None, "tiled"),
          "gpu": ("native", "generic", "tiled")}


def _same_calls(whole: Recorder, part: Recorder, what: Any) -> None:
    for key, calls in part.calls.items():
        assert key in whole.calls, (what, key, sorted(whole.calls))
        # A tile the part computes more than once (a float32 re-run) repeats the same list.
        first = whole.calls[key]
        assert len(calls) % len(first) == 0, (what, key)
        for i in range(0, len(calls), len(first)):
            assert calls[i:i + len(first)] == first, (what, key)


@pytest.mark.parametrize("setup,dtype", [("cpu-default", torch.float32),
                                         ("cpu-default", torch.bfloat16),
                                         ("cpu-tiled", torch.float32),
                                         ("cpu-tiled", torch.float16),
                                         ("gpu", torch.bfloat16), ("gpu", torch.float16)])
@pytest.mark.parametrize("variant", ["plain", "window", "alibi", "budget"])
def test_every_tile_sees_the_same_calls_in_every_slicing(setup, dtype, variant, monkeypatch, force):
    if dtype == torch.float16 and not cpu_half_gemm():
        pytest.skip("no float16 GEMM on this CPU torch")
    compute, layout, path = SETUPS[setup]
    force(compute=compute, layout=layout, path=path)
    length, heads, kv = 600, 4, 2
    p = prompt(length, heads, kv, 32, dtype, seed=26)
    kw: Dict[str, Any] = {}
    if variant == "window":
        kw["sliding_window"] = 300
    elif variant == "alibi":
        kw["alibi_slopes"] = torch.linspace(0.01, 0.05, heads)
    elif variant == "budget":  # key groups of 256: tiles over several, tiles halving from 256
        kw["budget_mb"] = 1
    whole = _recorded(monkeypatch, lambda: prefix_rows(p, [(0, length)], **kw))
    for steps in (chunked(length, 37), chunked(length, 256), chunked(length, 5)[:6],
                  hit(length, 256), hit(length, 512, 530), hit(length, 48, 49)):
        part = _recorded(monkeypatch, lambda steps=steps: prefix_rows(p, steps, **kw))
        _same_calls(whole, part, steps)
    dense = _recorded(monkeypatch, lambda: dense_rows(p, **kw))
    _same_calls(whole, dense, "dense")
    if variant == "budget" and path == "tiled":  # tiles over two key groups were recorded
        firsts = [key[1] for key in whole.calls if key[0] == "tiled"]
        assert len(firsts) > len(set(firsts)), sorted(whole.calls)


def test_a_float32_rerun_is_per_tile_and_the_same_calls(monkeypatch, force):
    """Rows whose float16 scores overflow run again in float32: one absolute tile, the same
    calls in every slicing."""
    if not cpu_half_gemm():
        pytest.skip("no float16 GEMM on this CPU torch")
    force(compute="native", layout="generic", path="tiled")
    p = prompt(300, 4, 1, 128, torch.float16, seed=5)
    loud = torch.arange(300) % 7 == 3
    p["q"][loud] = 100.0
    p["k"][loud] = 100.0
    whole = _recorded(monkeypatch, lambda: prefix_rows(p, [(0, 300)]))
    assert any(key[-1] == torch.float32 for key in whole.calls)
    for steps in (chunked(300, 23), hit(300, 64, 70)):
        _same_calls(whole, _recorded(monkeypatch, lambda steps=steps: prefix_rows(p, steps)),
                    steps)


# --- decode: each batch element's matrix is the same alone and with batch mates ---------


class _Elements(TorchDispatchMode):
    """The per-element matrices (shape and strides without the batch dimension, dtype) of
    every batched product."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: List[tuple] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if _is_product(name):
            mats = [a for a in args if isinstance(a, torch.Tensor)][-2:]
            self.seen.append((name.rstrip("_"), tuple(
                (tuple(m.shape[-2:]), m.stride()[-2:], m.dtype) for m in mats)))
        return func(*args, **kwargs)


@pytest.mark.parametrize("formulation", ["cpu", "gpu"])
def test_decode_elements_do_not_depend_on_the_batch(formulation, force):
    if formulation == "gpu":
        if not cpu_half_gemm():
            pytest.skip("no float16 GEMM on this CPU torch")
        force(compute="native", layout="generic")
        dtype = torch.float16
    else:
        dtype = torch.float32
    g = torch.Generator().manual_seed(26)
    bs, kv, d, heads = 16, 2, 64, 8
    lens = [700, 3000, 1, 9000]
    blocks = [math.ceil(n / bs) for n in lens]
    kc, vc = make_cache(sum(blocks) + 1, kv, d, bs, dtype, "auto", g)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    at = 1
    for i, n in enumerate(blocks):
        table[i, :n] = torch.arange(at, at + n, dtype=torch.int32)
        at += n
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    kinds: List[set] = []
    for rows in ([0], [0, 1, 2, 3]):
        rec = _Elements()
        idx = torch.tensor(rows)
        width = max(blocks[i] for i in rows)
        with rec:
            paged_decode(q[idx], kc, vc, table[idx, :width].clone(), seq_lens[idx], 0.125,
                         max_seq_len=max(lens[i] for i in rows))
        assert rec.seen
        kinds.append(set(rec.seen))
    assert kinds[0] == kinds[1], (kinds[0] ^ kinds[1])


# --- decode, device path: whole calls, batch dimension included ----------------------------

#: Reductions whose result no order of summation can change (the maximum is exact; the L1
#: norm of ``bounded_query`` sums float16 magnitudes in float64, exactly).
_EXACT = {"amax", "max", "min", "linalg_vector_norm"}
_REDUCTIONS = {"sum", "mean", "amax", "max", "min", "linalg_vector_norm", "norm", "logsumexp",
               "cumsum", "prod", "var", "std"}


class _Calls(TorchDispatchMode):
    """Every product and reduction with its full operand signature (``_operand``)."""

    def __init__(self) -> None:
        super().__init__()
        self.products: set = set()
        self.exact: List[tuple] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__.rstrip("_")
        if _is_product(name) or name in _REDUCTIONS:
            sig = (name, _operand(args), tuple(sorted((k, _operand(v))
                                                      for k, v in kwargs.items())))
            if name in _EXACT:
                self.exact.append((name, [a.dtype for a in args
                                          if isinstance(a, torch.Tensor)], kwargs.get("dtype")))
            else:
                self.products.add(sig)
        return func(*args, **kwargs)


def _decode_batches(dtype):
    """A target sequence alone (tight table, its own bound) and in batches: mates shorter,
    longer (past 8,192 tokens), empty; another order; padding columns; an inflated bound;
    budgets from one pass down to one sequence per pass."""
    g = torch.Generator().manual_seed(34)
    bs, kv, d, heads = 16, 2, 64, 8
    lens = [2500, 9000, 17, 0, 4100]
    blocks = [max(1, math.ceil(n / bs)) for n in lens]
    kc, vc = make_cache(sum(blocks) + 1, kv, d, bs, dtype, "auto", g)
    width = max(blocks) + 7
    table = torch.full((len(lens), width), 10_000, dtype=torch.int32)
    at = 1
    for i, n in enumerate(blocks):
        table[i, :n] = torch.arange(at, at + n, dtype=torch.int32)
        at += n
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    sl = torch.tensor(lens, dtype=torch.int32)
    spec = check_cache(kc, vc, dtype, "auto")
    least = decode.minimum_working_set(q, spec, 20_000) >> 20
    alone = ([0], blocks[0], 2500, 256)
    batches = [([0, 1, 2, 3, 4], width, None, 256), ([3, 4, 0, 2, 1], width, 20_000, 256),
               ([2, 0], blocks[0], 2500, 256), ([0, 1, 2, 3, 4], width, 9000, least + 1),
               ([1, 0, 4], width, 9000, 1)]
    return (q, kc, vc, table, sl), alone, batches


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_device_products_are_fixed_whatever_the_batch(dtype, force):
    """Every product and inexact reduction of a decode call, batch dimension, strides,
    alignment and dtype included, is one of the calls the target sequence makes alone (and
    vice versa): the batch mates, their order, the block table's padding columns, the bound
    and the budget's passes change how many there are, never what they are."""
    if dtype == torch.float16 and not cpu_half_gemm():
        pytest.skip("no float16 GEMM on this CPU torch")
    force(compute="native", layout="generic")
    (q, kc, vc, table, sl), alone, batches = _decode_batches(dtype)

    def record(rows, width, bound, budget):
        rec = _Calls()
        idx = torch.tensor(rows)
        with rec:
            paged_decode(q[idx], kc, vc, table[idx, :width].clone(), sl[idx], 0.125,
                         max_seq_len=bound, budget_mb=budget)
        return rec

    ref = record(*alone)
    assert {sig[0] for sig in ref.products} == (
        {"bmm", "sum"} if dtype == torch.float32 else {"bmm", "baddbmm", "sum"}), ref.products
    assert len(ref.products) == (3 if dtype == torch.float32 else 4), ref.products
    for case in batches:
        rec = record(*case)
        assert rec.products == ref.products, (case, rec.products ^ ref.products)
        for name, _, acc in rec.exact:
            assert name != "linalg_vector_norm" or acc == torch.float64, (case, name, acc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_device_rows_are_bit_identical_whatever_the_batch(dtype, threads,
                                                                 force):
    """The same batches, compared bit for bit at one thread and at torch's default count
    (the issue's case: a sequence of one tile alone, batch count 1, against it beside a
    mate)."""
    if dtype == torch.float16 and not cpu_half_gemm():
        pytest.skip("no float16 GEMM on this CPU torch")
    force(compute="native", layout="generic")
    (q, kc, vc, table, sl), alone, batches = _decode_batches(dtype)

    def row(rows, width, bound, budget):
        idx = torch.tensor(rows)
        out = paged_decode(q[idx], kc, vc, table[idx, :width].clone(), sl[idx], 0.125,
                           max_seq_len=bound, budget_mb=budget)
        return out[rows.index(0)]

    want = row(*alone)
    assert bool(want.isfinite().all())
    for case in batches:
        got = row(*case)
        assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), case
