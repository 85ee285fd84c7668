"""How the kernels compute on a device: the compute mode (``"fp32"`` on CPU, ``"native"``
elsewhere) and the dtype it holds tiles in, the CPU tile layouts' switch, and the matrix
products under them (float32 accumulation, a query bounded so that no half-precision score
overflows).  ``kernels.forced`` overrides the choices (tests and the benchmark).

Everything here works on plain tensors and never imports vLLM.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .forced import forcing


def fast_layout(device: torch.device) -> bool:
    """Whether to use the CPU-tuned tile layouts (see ``_gather``).

    On CPU, strided copies with a short or strided inner dimension are slow, so keys are
    transposed as 16-byte units and decode values are consumed block by block without a
    transpose.  Other devices handle strided copies well and gather each tile in one
    strided ``index_select``.  ``forced(layout="fast"/"generic")`` overrides the choice
    (tests use it).
    """
    layout = forcing().layout
    if layout is not None:
        return layout == "fast"
    return device.type == "cpu"


def compute_mode(device: torch.device) -> str:
    """How the kernels compute on ``device``: ``"fp32"`` or ``"native"``.

    ``"fp32"`` (CPU): gathered K/V tiles are converted to float32 and both matrix products
    run in float32: exact to float32, and what CPUs without fast half-precision GEMMs do
    fastest.  ``"native"`` (every other device): K/V tiles stay in the query's dtype (fp8
    caches are dequantised to it), ``Q.K^T`` and ``P.V`` take float16/bfloat16 inputs
    (tensor cores) and accumulate in float32 inside the GEMM (cuBLAS' default compute
    type); the running max, sum and output accumulator stay float32.  A GEMM's output is
    in its input dtype, so scores and each tile's ``P.V`` are rounded once to it: the
    error this adds is what the kernels' tests bound per dtype, on CPU, with this mode
    forced.  Nothing rounded to float16 may overflow (its range ends at 65,504): decode
    bounds the query (``bounded_query``) and normalises each tile's probabilities, the
    tiled prefix normalises each row's weights (one softmax over its query tile's row)
    and recomputes in float32 a row whose float16 scores overflowed (see those modules;
    ``docs/bi100-limits.md`` states what is guaranteed).  ``forced(compute=...)`` overrides
    the choice (tests and the benchmark).
    """
    compute = forcing().compute
    if compute is not None:
        return compute
    return "fp32" if device.type == "cpu" else "native"


def work_dtype(query_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype K/V tiles, scores and probabilities are held in (see ``compute_mode``)."""
    return torch.float32 if compute_mode(device) == "fp32" else query_dtype


def accumulate_bmm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   weight: Optional[torch.Tensor] = None) -> None:
    """``acc += (a @ b) * weight`` (batched); ``acc`` and ``weight`` (broadcast against the
    product, e.g. one factor per row or per column) are float32, ``a``/``b`` in the work
    dtype; no ``weight`` means 1."""
    if a.dtype == torch.float32 and weight is None:
        acc.baddbmm_(a, b)
        return
    product = torch.bmm(a, b)
    product = product if product.dtype == torch.float32 else product.float()
    if weight is None:
        acc.add_(product)  # same-dtype add: the fast path
    else:
        acc.addcmul_(product, weight)


def scores_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (batched) as float32, from operands in the work dtype."""
    product = torch.bmm(a, b)
    return product if product.dtype == torch.float32 else product.float()


def pow2_at_least(t: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``>= t`` (float32, elementwise; ``t`` >= 0, 0 gives the
    smallest normal float32): dividing by it is exact, so operands keep every bit."""
    tiny = torch.finfo(torch.float32).tiny
    return torch.exp2(torch.ceil(torch.log2(t.float().clamp_min(tiny))))


def bounded_query(q: torch.Tensor, dtype: torch.dtype, out: Optional[torch.Tensor] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``q`` split as ``q' * step`` for half-precision score products: ``(q', step)``.

    ``step`` (float32, ``[..., 1]``) is the smallest power of two above the L1 norm of each
    row (last dimension; 1 for a zero row) and ``q' = q / step`` in ``dtype`` (written into
    ``out``, which may broadcast ``q`` over leading dimensions, when given).  Dividing by a
    power of two is exact (float16 components below ``2**-14`` of it lose low bits), so
    ``sum |q'| < 1`` and ``|q' . k| < max |k|`` for every key: a product of ``q'`` with keys
    finite in ``dtype`` is finite in ``dtype`` whatever its reduction order.  The float32
    scores are ``(q' . k) * step``.

    The L1 norm, not ``head_size * max |q|``, keeps the small components of a query with an
    outlier channel out of float16's subnormal range: a component keeps full precision down
    to ``2**-14`` of the row's L1 norm (smaller ones add at most ``2**-25`` of it each to a
    score).

    The norm is summed in float64: exact for float16 queries (every partial sum of float16
    magnitudes is a multiple of ``2**-24`` below ``2**24``), so no summation order (a
    reduction's split follows the shape of the whole call) changes it; for other dtypes a
    different order could move it across a power of two only where it lies within ``2**-44``
    of one, and a step twice as large scales every product exactly (no bit of a result
    changes but in the subnormal range)."""
    norm = torch.linalg.vector_norm(q, 1, dim=-1, keepdim=True, dtype=torch.float64)
    step = torch.pow(2.0, torch.frexp(norm).exponent)  # norm = m * 2**e, 1/2 <= m < 1
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    torch.div(q.expand(out.shape), step, out=out)
    return out, step
