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

Decode (batch invariance): a sequence's tiles go through batched products whose batch
count follows the batch; what must not change is each batch element's matrix (shape and
strides of the per-element operands), asserted alone and with batch mates.
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

from vllm_bi100_patch.kernels import _common, paged_decode
from vllm_bi100_patch.kernels.prefill import _sdpa as _prefix_sdpa
from vllm_bi100_patch.kernels.prefill import _tiled as _prefix_tiled
from vllm_bi100_patch.kernels.prefill import prefix

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
    monkeypatch.setattr(_prefix_tiled, "TRACE", rec.trace)
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
def test_every_tile_sees_the_same_calls_in_every_slicing(setup, dtype, variant, monkeypatch):
    if dtype == torch.float16 and not cpu_half_gemm():
        pytest.skip("no float16 GEMM on this CPU torch")
    compute, layout, path = SETUPS[setup]
    monkeypatch.setattr(_common, "FORCE_COMPUTE", compute)
    monkeypatch.setattr(_common, "FORCE_LAYOUT", layout)
    monkeypatch.setattr(prefix, "FORCE_PATH", path)
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


def test_a_float32_rerun_is_per_tile_and_the_same_calls(monkeypatch):
    """Rows whose float16 scores overflow run again in float32: one absolute tile, the same
    calls in every slicing."""
    if not cpu_half_gemm():
        pytest.skip("no float16 GEMM on this CPU torch")
    monkeypatch.setattr(_common, "FORCE_COMPUTE", "native")
    monkeypatch.setattr(_common, "FORCE_LAYOUT", "generic")
    monkeypatch.setattr(prefix, "FORCE_PATH", "tiled")
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
def test_decode_elements_do_not_depend_on_the_batch(formulation, monkeypatch):
    if formulation == "gpu":
        if not cpu_half_gemm():
            pytest.skip("no float16 GEMM on this CPU torch")
        monkeypatch.setattr(_common, "FORCE_COMPUTE", "native")
        monkeypatch.setattr(_common, "FORCE_LAYOUT", "generic")
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
