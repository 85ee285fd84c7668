"""Attention at vLLM's own precision in the GPU compute mode (issue 34, item 1).

In the GPU compute mode (products in the cache's half dtype, what every BI-V100 card runs)
a score ``q.k * scale`` used to be rounded to float16/bfloat16 at its own magnitude before
the row's maximum was subtracted: at large logits or sink tokens 10-100x less precise than
vLLM's CUDA kernel, whose scores are float32.  The bar, per row of the issue's table (logit
standard deviation 1, 5, 10, 30; four sink keys 10, 50, 100, 200 above std-1 logits),
float16 and bfloat16: the median relative error against float64 is at most twice the
*float32-score reference*'s (float32 ``q.k`` and softmax, probabilities rounded to the half
dtype, float32 ``P.V``: ``selftest.precision.float32_score_reference``).  Decode at the
issue's shape (4 query / 1 KV heads of 128 over 4,096 tokens), the prefix (512 cached + 256
new: keys in one group, and under a 1 MiB budget in several, tiles spanning them; ALiBi; a
sliding window) and the dense kernel over the whole 768-token prompt (the same variants).
The tiled path is forced, as on a card (the CPU's SDPA path never runs there).
"""

from __future__ import annotations

import pytest
import torch
from helpers.reference import cpu_half_gemm

from vllm_bi100_patch.ops.selftest.precision import LOGITS, MAX_RATIO, precision_results

DTYPES = [torch.bfloat16] + ([torch.float16] if cpu_half_gemm() else [])
CASES = [("decode", "plain")] + [(kernel, variant) for kernel in ("prefix", "dense")
                                 for variant in ("plain", "groups", "alibi", "window")]


@pytest.fixture
def gpu_mode(force):
    force(compute="native", layout="generic", path="tiled")


@pytest.mark.parametrize("kernel,variant", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_median_error_within_twice_the_float32_score_reference(kernel, variant, dtype,
                                                               gpu_mode):
    rows = precision_results(torch.device("cpu"), [dtype], [kernel], variants=[variant])
    assert [r["row"] for r in rows] == [f"{kind} {size:g}" for kind, size in LOGITS]
    worse = [(r["row"], round(r["ratio"], 2), f"{r['error']:.2e}", f"{r['reference']:.2e}")
             for r in rows if not r["ratio"] <= MAX_RATIO]
    assert not worse, worse


def test_the_reference_is_what_the_issue_measured():
    """The float32-score reference's own errors (decode, bfloat16): 1.5-3e-3 in every row, as
    the issue's table gives for vLLM's kernel (1.7e-3 to 2.5e-3): the bar is not a loose
    one."""
    rows = precision_results(torch.device("cpu"), [torch.bfloat16], ["decode"])
    for r in rows:
        assert 1e-3 < r["reference"] < 3e-3, r
