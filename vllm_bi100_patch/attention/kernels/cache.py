"""The paged KV caches as the kernels take them, and the checks of every argument against them.

Cache layout (vLLM, CUDA and CPU alike), with ``x = 16 // element_size``::

    key_cache   [num_blocks, num_kv_heads, head_size // x, block_size, x]
    value_cache [num_blocks, num_kv_heads, head_size, block_size]

``check_cache`` validates the two caches against each other and ``kv_cache_dtype`` and returns
their ``CacheSpec``; the other checks name the argument and the offending value.  Everything
here works on plain tensors and never imports vLLM.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import torch


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
