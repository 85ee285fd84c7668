"""Batch invariance of the decode kernel (issue 20): a sequence's output is bit-identical
whatever else is in the call.

Property: the output row of one "target" sequence decoded alone (its own tight block table)
equals, bit for bit, its row when it is decoded together with random batch mates (shorter,
longer, empty, longer than 8,192 tokens so that the gathered width changes a lot), at a random
place in the batch, with padding columns in the block table (garbage ids), with or without
``max_seq_len``, under a memory budget that forces several passes or not; in both compute
modes (and both CPU tile layouts), float32 / float16 / bfloat16, fp8 caches, GQA and ALiBi.
"""

from __future__ import annotations

import math

import torch
from helpers.reference import cpu_half_gemm, fp8_available, make_cache
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_bi100_patch.attention.kernels.forced import forced
from vllm_bi100_patch.attention.kernels import paged_decode

#: (tile layout, compute mode), as the ``formulation`` fixture of ``conftest.py``.
FORMULATIONS = {"cpu": ("fast", "fp32"), "generic-fp32": ("generic", "fp32"),
                "gpu": ("generic", "native")}
_DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if cpu_half_gemm() else [])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


@st.composite
def batches(draw):
    """A target length, its batch mates, its place, and the call's options."""
    target = draw(st.integers(1, 2600))
    mates = draw(st.lists(st.integers(0, 2600), min_size=0, max_size=3))
    if draw(st.booleans()):
        mates.append(draw(st.integers(8200, 11000)))
    mates = draw(st.permutations(mates))
    place = draw(st.integers(0, len(mates)))
    return {
        "target": target, "mates": mates, "place": place,
        "formulation": draw(st.sampled_from(sorted(FORMULATIONS))),
        "dtype": draw(st.sampled_from(_DTYPES)),
        "fp8": draw(st.booleans()) and fp8_available("fp8"),
        "kv_heads": draw(st.sampled_from([1, 2])),
        "group": draw(st.sampled_from([1, 4])),
        "block_size": draw(st.sampled_from([8, 16])),
        "alibi": draw(st.booleans()),
        "pad_columns": draw(st.integers(0, 40)),
        "bound": draw(st.sampled_from(["tight", "none", "inflated"])),
        "budget_mb": draw(st.sampled_from([256, 1])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _run(case: dict) -> None:
    g = torch.Generator().manual_seed(case["seed"])
    bs, kv, d = case["block_size"], case["kv_heads"], 32
    heads = kv * case["group"]
    lens = list(case["mates"])
    lens.insert(case["place"], case["target"])
    blocks = [math.ceil(n / bs) for n in lens]
    num_blocks = sum(blocks) + 2
    kv_dtype = "fp8" if case["fp8"] else "auto"
    dtype = torch.bfloat16 if case["fp8"] and case["dtype"] == torch.float32 else case["dtype"]
    kc, vc = make_cache(num_blocks, kv, d, bs, dtype, kv_dtype, g)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    width = max(blocks) + case["pad_columns"]
    table = torch.full((len(lens), width), 10_000, dtype=torch.int32)  # garbage padding
    at = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[at:at + n]
        at += n
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    kw = {"kv_cache_dtype": kv_dtype, "k_scale": 0.5, "v_scale": 2.0,
          "alibi_slopes": torch.rand(heads, generator=g) if case["alibi"] else None}
    bound = {"tight": max(lens), "none": None, "inflated": 20_000}[case["bound"]]
    i, n = case["place"], blocks[case["place"]]
    alone = paged_decode(q[i:i + 1], kc, vc, table[i:i + 1, :max(n, 1)].clone(),
                         seq_lens[i:i + 1], 0.17, max_seq_len=case["target"], **kw)
    batched = paged_decode(q, kc, vc, table, seq_lens, 0.17, max_seq_len=bound,
                           budget_mb=case["budget_mb"], **kw)
    assert torch.equal(_bits(batched[i:i + 1]), _bits(alone)), (
        (batched[i:i + 1].double() - alone.double()).abs().max())


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=batches())
def test_decode_output_independent_of_the_batch(case, threads):
    layout, compute = FORMULATIONS[case["formulation"]]
    with forced(layout=layout, compute=compute):
        _run(case)
