"""Shared helpers for the pure-PyTorch paged-attention kernels.

Cache layout (vLLM, CUDA and CPU alike), with ``x = 16 // element_size``::

    key_cache   [num_blocks, num_kv_heads, head_size // x, block_size, x]
    value_cache [num_blocks, num_kv_heads, head_size, block_size]

Everything here works on plain tensors and never imports vLLM.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple, Union

import torch

from .forced import forcing


ScaleLike = Union[float, torch.Tensor]

#: ``kv_cache_dtype`` strings that mean an fp8 cache, and the float8 dtype each one is stored as.
_FP8_NAMES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """What the validated caches look like.

    ``storage_dtype`` is the dtype the cache tensors are stored in; ``view_dtype`` is the
    dtype to reinterpret them as before converting to float32 (differs only for fp8 caches
    stored as uint8); ``fp8`` says whether ``k_scale``/``v_scale`` apply.
    """

    num_blocks: int
    num_kv_heads: int
    head_size: int
    block_size: int
    x: int
    storage_dtype: torch.dtype
    view_dtype: torch.dtype
    fp8: bool


def fp8_dtype(kv_cache_dtype: str) -> torch.dtype:
    """The torch float8 dtype for an fp8 ``kv_cache_dtype`` string.

    Raises NotImplementedError when this torch build has no such dtype.
    """
    name = _FP8_NAMES[kv_cache_dtype]
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise NotImplementedError(
            f"kv_cache_dtype={kv_cache_dtype!r} needs torch.{name}, which this torch "
            f"({torch.__version__}) does not provide")
    return dtype


def check_cache(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_dtype: torch.dtype,
    kv_cache_dtype: str,
) -> CacheSpec:
    """Validate the two paged caches against each other and ``kv_cache_dtype``.

    Raises ValueError naming the argument and the offending values.
    """
    if query_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"query dtype {query_dtype} is not supported; expected one of "
                         f"float32, float16, bfloat16")
    if key_cache.dim() != 5:
        raise ValueError(
            "key_cache must be 5-D [num_blocks, num_kv_heads, head_size // x, block_size, x], "
            f"got shape {tuple(key_cache.shape)}")
    if value_cache.dim() != 4:
        raise ValueError(
            "value_cache must be 4-D [num_blocks, num_kv_heads, head_size, block_size], "
            f"got shape {tuple(value_cache.shape)}")
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key_cache dtype {key_cache.dtype} != value_cache dtype "
                         f"{value_cache.dtype}")
    if kv_cache_dtype == "auto":
        if key_cache.dtype != query_dtype:
            raise ValueError(
                f"kv_cache_dtype='auto' needs the cache dtype to equal the query dtype; "
                f"key_cache is {key_cache.dtype}, query is {query_dtype}")
        view_dtype = key_cache.dtype
        fp8 = False
    elif kv_cache_dtype in _FP8_NAMES:
        view_dtype = fp8_dtype(kv_cache_dtype)
        if key_cache.dtype not in (torch.uint8, view_dtype):
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} needs a uint8 (or {view_dtype}) cache, "
                f"got key_cache dtype {key_cache.dtype}")
        fp8 = True
    else:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported; expected 'auto', "
            f"{', '.join(repr(n) for n in _FP8_NAMES)}")
    num_blocks, num_kv_heads, head_chunks, block_size, x = key_cache.shape
    head_size = head_chunks * x
    expected_x = 16 // key_cache.element_size()
    if x != expected_x:
        raise ValueError(
            f"key_cache last dim x={x} but 16 // element_size = {expected_x} for "
            f"{key_cache.dtype}; shape {tuple(key_cache.shape)}")
    expected_v = (num_blocks, num_kv_heads, head_size, block_size)
    if tuple(value_cache.shape) != expected_v:
        raise ValueError(
            f"value_cache shape {tuple(value_cache.shape)} does not match key_cache shape "
            f"{tuple(key_cache.shape)}: expected {expected_v}")
    if key_cache.device != value_cache.device:
        raise ValueError(f"key_cache on {key_cache.device}, value_cache on "
                         f"{value_cache.device}")
    if num_kv_heads < 1 or block_size < 1 or head_size < 1:
        raise ValueError(f"empty cache dimensions: key_cache shape {tuple(key_cache.shape)}")
    return CacheSpec(num_blocks, num_kv_heads, head_size, block_size, x,
                     key_cache.dtype, view_dtype, fp8)


def check_heads(num_heads: int, head_size: int, spec: CacheSpec, arg: str = "query") -> int:
    """Check head counts and size against the cache; return the GQA group size."""
    if head_size != spec.head_size:
        raise ValueError(f"{arg} head_size {head_size} does not match the cache head_size "
                         f"{spec.head_size}")
    if head_size % spec.x != 0:
        raise ValueError(f"head_size {head_size} is not supported: it must be a multiple of "
                         f"x={spec.x}")
    if num_heads < 1 or num_heads % spec.num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} ({arg}) must be a positive multiple of "
                         f"num_kv_heads {spec.num_kv_heads}")
    return num_heads // spec.num_kv_heads


def check_alibi(alibi_slopes: Optional[torch.Tensor], num_heads: int) -> None:
    """ALiBi slopes must be one float per query head."""
    if alibi_slopes is None:
        return
    if alibi_slopes.dim() != 1 or alibi_slopes.shape[0] != num_heads:
        raise ValueError(f"alibi_slopes must have shape [{num_heads}] (one per query head), "
                         f"got {tuple(alibi_slopes.shape)}")


def check_int_tensor(t: torch.Tensor, name: str, shape: Sequence[Optional[int]]) -> None:
    """An integer tensor of the given rank; ``None`` entries in ``shape`` are free."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.dim() != len(shape) or any(
            want is not None and got != want for got, want in zip(t.shape, shape)):
        want_s = "[" + ", ".join("?" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"{name} must have shape {want_s}, got {tuple(t.shape)}")


def scale_factor(scale: ScaleLike, name: str) -> ScaleLike:
    """A scale as a Python float, or a float32 0-dim tensor (kept on device, no sync)."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"{name} must be a float or a 1-element tensor, got shape "
                             f"{tuple(scale.shape)}")
        return scale.reshape(()).to(torch.float32)
    try:
        return float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a float or a 1-element tensor, got {scale!r}") from None


def to_float(t: torch.Tensor, spec: CacheSpec) -> torch.Tensor:
    """Reinterpret a (gathered) cache slice as its logical dtype, without copying."""
    if spec.view_dtype != t.dtype:
        return t.view(spec.view_dtype)
    return t


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


def as_count(name: str, value: object) -> int:
    """``value`` as an int >= 0 (``max_seq_len`` and the like), else ValueError naming it."""
    try:
        number = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}") from None
    if number < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return number


def ceil_div(a: int, b: int) -> int:
    """Integer ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)
