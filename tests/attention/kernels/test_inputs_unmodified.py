"""No kernel writes into its inputs: query, key, value and both caches come back bit-identical
from decode, prefix (both paths), the dense prompt attention and the fp8 cache write, in
float32, float16 and bfloat16, in every formulation (both compute modes).

The field's T8 bug was ``query.float().mul_(scale)``: on a float32 query ``.float()`` is the
query itself, so the caller's query was scaled in place.  Scales, ALiBi slopes and a sliding
window are set so that every in-place step a kernel could take is on the path."""

from __future__ import annotations

from typing import Dict

import pytest
import torch
from helpers.reference import decode_inputs, fp8_available, prefix_inputs

from vllm_bi100_patch.attention.kernels import kv_write, paged_decode, paged_prefix
from vllm_bi100_patch.attention.kernels.prefill import dense

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _snapshot(**tensors: torch.Tensor) -> Dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in tensors.items()}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _assert_same(before: Dict[str, torch.Tensor], **after: torch.Tensor) -> None:
    """Bit-identical: the raw bytes (a NaN would compare unequal to itself otherwise)."""
    for name, t in after.items():
        assert torch.equal(_bytes(t), _bytes(before[name])), f"{name} was modified"


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_leaves_its_inputs_alone(formulation, dtype):
    q, kc, vc, bt, sl = decode_inputs(dtype, 64, 3.0, seed=5)
    slopes = torch.linspace(0.1, 0.8, q.shape[1])
    before = _snapshot(query=q, key_cache=kc, value_cache=vc, block_tables=bt, seq_lens=sl,
                       alibi=slopes)
    paged_decode(q, kc, vc, bt, sl, 0.37, alibi_slopes=slopes)
    _assert_same(before, query=q, key_cache=kc, value_cache=vc, block_tables=bt, seq_lens=sl,
                 alibi=slopes)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_leaves_its_inputs_alone(formulation, path, dtype):
    q, k, v, kc, vc, bt, qsl, sl, cl = prefix_inputs(dtype, 64, 3.0, seed=6)
    slopes = torch.linspace(0.1, 0.8, q.shape[1])
    names = dict(query=q, key=k, value=v, key_cache=kc, value_cache=vc, block_tables=bt,
                 query_start_loc=qsl, seq_lens=sl, context_lens=cl, alibi=slopes)
    before = _snapshot(**names)
    paged_prefix(q, k, v, kc, vc, bt, qsl, sl, cl, scale=0.37, alibi_slopes=slopes)
    paged_prefix(q, k, v, kc, vc, bt, qsl, sl, cl, scale=0.37, sliding_window=20)
    _assert_same(before, **names)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_prompt_attention_leaves_its_inputs_alone(formulation, dtype):
    g = torch.Generator().manual_seed(7)
    lens = [3, 40, 17]
    q = torch.randn(sum(lens), 8, 64, generator=g).to(dtype)
    k = torch.randn(sum(lens), 2, 64, generator=g).to(dtype)
    v = torch.randn(sum(lens), 2, 64, generator=g).to(dtype)
    slopes = torch.linspace(0.1, 0.8, 8)
    before = _snapshot(query=q, key=k, value=v, alibi=slopes)
    dense.varlen_attention(q, k, v, lens, 0.37, alibi_slopes=slopes, budget_mb=1)
    dense.varlen_attention(q, k, v, lens, 0.37, sliding_window=5, budget_mb=1)
    dense.varlen_attention(q, k, v, lens, 0.37, causal=False, budget_mb=1)
    _assert_same(before, query=q, key=k, value=v, alibi=slopes)


@pytest.mark.skipif(not fp8_available(), reason="torch without float8 dtypes")
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_write_and_fp8_reads_leave_their_inputs_alone(formulation, dtype):
    q, k, v, kc, vc, bt, qsl, sl, cl = prefix_inputs(dtype, 64, 3.0, seed=8)
    kc8 = torch.zeros(kc.shape[0], 2, 64 // 16, 16, 16, dtype=torch.uint8)
    vc8 = torch.zeros(kc.shape[0], 2, 64, 16, dtype=torch.uint8)
    slots = torch.arange(k.shape[0])
    before = _snapshot(key=k, value=v, slots=slots)
    kv_write.write_fp8(k, v, kc8, vc8, slots, "fp8", 0.5, 0.25)
    _assert_same(before, key=k, value=v, slots=slots)
    cached = _snapshot(query=q, key=k, value=v, key_cache=kc8, value_cache=vc8)
    paged_prefix(q, k, v, kc8, vc8, bt, qsl, sl, cl, scale=0.37, kv_cache_dtype="fp8",
                 k_scale=0.5, v_scale=0.25)
    paged_decode(q[:4], kc8, vc8, bt, cl, 0.37, kv_cache_dtype="fp8", k_scale=0.5,
                 v_scale=0.25)
    _assert_same(cached, query=q, key=k, value=v, key_cache=kc8, value_cache=vc8)
