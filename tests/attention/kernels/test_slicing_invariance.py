"""Same prompt, same answer (issue 20): every output row of the prefix and dense kernels is
bit-identical however vLLM slices the prompt (one chunk, chunked prefill at any size, a
prefix-cache hit of any length, a hit followed by the rest of a partly filled block, any
batch mates in any order), in both compute modes, on every path, and the dense kernel's rows
of an uncached prompt equal the prefix kernel's after a hit.

Rows are compared bit for bit as integers (the sign of zero counts) after the one-chunk
computation, through ``helpers.slicing`` (which writes the cache as vLLM does and poisons every slot past the
cached part with NaN).  ``selftest.checks.check_prefix_slicing_invariance`` (the package's) runs the
same comparisons on a GPU.  Invariance holds for one memory budget (the kernels' key groups
and tile sizes follow ``VLLM_BI100_PREFIX_BUDGET_MB``, a per-server setting): every comparison
here uses the default, but one that uses 1 MiB (tiles over several key groups, tile sizes
halving along the prompt).  The property runs at one thread and at the default thread count; that it holds
by construction, not by one machine's BLAS, is ``test_call_shapes.py``'s proof.
"""

from __future__ import annotations

import pytest
import torch
from helpers.reference import cpu_half_gemm, fp8_available
from helpers.slicing import chunked, dense_rows, hit, prefix_rows, prompt, same_rows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


#: (compute mode, layout, path) as the kernels run them: CPU default (SDPA where allowed),
#: CPU tiled (fp32 mode: ALiBi, float16, over budget), the GPU compute mode (tiled).
SETUPS = {"cpu-default": ("fp32", None, None), "cpu-tiled": ("fp32", None, "tiled"),
          "gpu": ("native", "generic", "tiled")}


def _setup(force, name: str) -> None:
    compute, layout, path = SETUPS[name]
    force(compute=compute, layout=layout, path=path)


# --- issue 20's table, as filed: 1,024 tokens, 8/2 heads of 128, block 16 ----------------

SLICINGS = {
    "chunks of 512": chunked(1024, 512),
    "hit of 896": hit(1024, 896),
    "hit ending inside a block, then the rest": hit(1024, 896, 901),
    "chunks of 37": chunked(1024, 37),
}


@pytest.mark.parametrize("setup,dtype", [("cpu-tiled", torch.float32),
                                         ("cpu-default", torch.bfloat16),
                                         ("gpu", torch.bfloat16)])
@pytest.mark.parametrize("slicing", sorted(SLICINGS))
def test_issue_table_rows_896_to_1023(setup, dtype, slicing, force):
    _setup(force, setup)
    p = prompt(1024, 8, 2, 128, dtype, seed=20)
    whole = prefix_rows(p, [(0, 1024)])
    steps = SLICINGS[slicing]
    rows = prefix_rows(p, steps)
    first = steps[0][0]
    assert same_rows(rows[896 - first:], whole[896:])


@pytest.mark.parametrize("setup,dtype", [("cpu-tiled", torch.float32),
                                         ("cpu-default", torch.bfloat16),
                                         ("gpu", torch.bfloat16), ("gpu", torch.float16)])
def test_head_256_dense_prompt_equals_prefix_after_a_hit(setup, dtype, force):
    """The vendor build's head-256 case: the uncached prompt through row ``dense_prefill``'s
    kernel, the same prompt with 896 tokens cached through the prefix kernel."""
    if dtype == torch.float16 and not cpu_half_gemm():
        pytest.skip("no float16 GEMM on this CPU torch")
    _setup(force, setup)
    p = prompt(1024, 8, 2, 256, dtype, seed=21)
    dense = dense_rows(p)
    assert same_rows(prefix_rows(p, hit(1024, 896)), dense[896:])
    assert same_rows(prefix_rows(p, [(0, 1024)]), dense)


# --- batch composition, order, GQA, ALiBi, window, fp8, both paths -----------------------

VARIANTS = {"gqa": {}, "window": {"sliding_window": 37}, "alibi": {"alibi": True}}


@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_slicings_and_batch_mates(setup, dtype, variant, force):
    if dtype == torch.float16 and SETUPS[setup][0] == "native" and not cpu_half_gemm():
        pytest.skip("no float16 GEMM on this CPU torch")
    _setup(force, setup)
    length, heads = 300, 8
    p = prompt(length, heads, 2, 32, dtype, seed=3)
    kw = dict(VARIANTS[variant])
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.linspace(0.05, 0.4, heads)
    whole = prefix_rows(p, [(0, length)], **kw)
    for steps, mates in ((chunked(length, 37), 0), (chunked(length, 128), 3),
                         (hit(length, 96), 2), (hit(length, 96, 100), 1),
                         (hit(length, 256), 0)):
        rows = prefix_rows(p, steps, mates=mates, seed=len(steps), **kw)
        assert same_rows(rows, whole[steps[0][0]:]), (steps, mates)
    assert same_rows(dense_rows(p, **kw), whole)


@pytest.mark.parametrize("setup,dtype", [("cpu-tiled", torch.float32), ("gpu", torch.float16),
                                         ("gpu", torch.bfloat16)])
def test_small_budget_tiles_over_several_key_groups(setup, dtype, force):
    """1 MiB: key groups of 256 positions (a tile's row spans two or three: its scores kept
    while K is staged group by group, its ``P.V`` added in group order) and tile sizes
    halving from 128 to 32 over the prompt; the rows are the same in every slicing."""
    if dtype == torch.float16 and not cpu_half_gemm():
        pytest.skip("no float16 GEMM on this CPU torch")
    _setup(force, setup)
    length = 700
    p = prompt(length, 4, 2, 32, dtype, seed=7)
    whole = prefix_rows(p, [(0, length)], budget_mb=1)
    for steps, mates in ((chunked(length, 37), 1), (hit(length, 496), 0),
                         (hit(length, 512, 530), 2), (chunked(length, 256), 0)):
        rows = prefix_rows(p, steps, mates=mates, seed=len(steps), budget_mb=1)
        assert same_rows(rows, whole[steps[0][0]:]), (steps, mates)
    assert same_rows(dense_rows(p, budget_mb=1), whole)


@pytest.mark.skipif(not fp8_available(), reason="torch without float8 dtypes")
@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_fp8_cache_new_tokens_read_as_cached(setup, force):
    """fp8 caches: a token's K/V are rounded through fp8 whether new in the call or cached
    by an earlier one, so the rows agree; the dense kernel does the same when told the cache
    format."""
    _setup(force, setup)
    p = prompt(200, 8, 2, 32, torch.bfloat16, seed=4)
    fp8 = {"kv_cache_dtype": "fp8"}
    whole = prefix_rows(p, [(0, 200)], **fp8)
    for steps in (chunked(200, 48), hit(200, 96, 101)):
        assert same_rows(prefix_rows(p, steps, mates=2, **fp8), whole[steps[0][0]:])
    dense = dense_rows(p, kv_cache_dtype="fp8", k_scale=0.5, v_scale=2.0)
    assert same_rows(dense, whole)


@pytest.mark.parametrize("setup", ["cpu-tiled", "gpu"])
def test_float16_rerun_is_decided_per_row(setup, force):
    """Rows whose float16 scores overflow (q = k = 100 in every component: scale * q.k is
    past 65,504) are recomputed in float32, per row: their neighbours keep their float16
    rows, and every slicing gives the same rows for both."""
    if not cpu_half_gemm():
        pytest.skip("no float16 GEMM on this CPU torch")
    _setup(force, setup)
    p = prompt(160, 4, 1, 128, torch.float16, seed=5)
    loud = torch.arange(160) % 7 == 3
    p["q"][loud] = 100.0
    p["k"][loud] = 100.0
    whole = prefix_rows(p, [(0, 160)])
    assert bool(torch.isfinite(whole).all())
    for steps in (chunked(160, 23), hit(160, 64, 70)):
        assert same_rows(prefix_rows(p, steps, mates=1), whole[steps[0][0]:])
    assert same_rows(dense_rows(p), whole)


# --- the property: random slicings ------------------------------------------------------


@st.composite
def slicings(draw, length: int):
    """Cut points in order: a first step starting at a prefix-cache hit (a block multiple,
    or 0) and later steps of any size."""
    start = draw(st.sampled_from([s for s in (0, 16, 32, 48) if s + 1 < length]))
    cuts = sorted(set(draw(st.lists(st.integers(start + 1, length - 1), max_size=4))))
    bounds = [start] + cuts + [length]
    return list(zip(bounds, bounds[1:]))


@settings(max_examples=75, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), setup=st.sampled_from(sorted(SETUPS)),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       kv=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]),
       extra=st.sampled_from(["none", "window", "alibi", "fp8"]),
       length=st.integers(20, 90), mates=st.integers(0, 2), seed=st.integers(0, 999))
def test_property_rows_do_not_depend_on_the_slicing(data, setup, dtype, kv, group, extra,
                                                     length, mates, seed, force,
                                                     threads):
    if dtype == torch.float16 and SETUPS[setup][0] == "native" and not cpu_half_gemm():
        return
    if extra == "fp8" and (dtype == torch.float32 or not fp8_available()):
        extra = "none"
    _setup(force, setup)
    heads = kv * group
    p = prompt(length, heads, kv, 32, dtype, seed)
    kw = {}
    if extra == "window":
        kw["sliding_window"] = data.draw(st.integers(1, 60))
    elif extra == "alibi":
        kw["alibi_slopes"] = torch.linspace(0.1, 0.8, heads)
    elif extra == "fp8":
        kw["kv_cache_dtype"] = "fp8"
    block = data.draw(st.sampled_from([8, 16]))
    steps = data.draw(slicings(length))
    whole = prefix_rows(p, [(0, length)], block_size=block, **kw)
    rows = prefix_rows(p, steps, block_size=block, mates=mates, seed=seed, **kw)
    assert same_rows(rows, whole[steps[0][0]:]), steps
    if extra != "fp8":
        assert same_rows(dense_rows(p, **kw), whole)
