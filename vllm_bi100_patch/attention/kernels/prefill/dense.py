"""Dense varlen attention for prompts without a block table, in pure PyTorch.

What vLLM's XFormers backend computes in ``_run_memory_efficient_xformers_forward``: several
prompts packed along the token axis (``query [T, H, D]``, ``key``/``value`` ``[T, KV, D]``),
each attending only to itself, causal (decoder self-attention) or not (encoder and
encoder/decoder cross-attention), with grouped-query heads (query head ``h`` reads KV head
``h // (H // KV)``), an optional sliding window (query ``i`` sees keys ``i - window < j <= i``,
xformers' local attention) and optional ALiBi slopes (bias ``slope[h] * (j - i)``, vLLM's
``_make_alibi_bias``; like vLLM's, the ALiBi path has no window: ``prefix.alibi_window``).

Causal attention runs on the prefix kernel's code (``prefill._attend``): a prompt is a prefix call
with an empty context, so every output row is bit-identical to the row the prefix kernel
computes for the same token after any prefix-cache hit or in any chunk of a chunked
prefill, in both compute modes.  Non-causal attention takes the tiled path with the running
max shift (the same for every dtype; invariance there is per call only).  Work is tiled
under ``budget_mb`` (``prefill._plan``); inputs are never written.  Never imports vLLM.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..forced import forcing
from ._attend import attend
from ..cache import ScaleLike, scale_factor
from ._plan import PrefixInputs, SeqSpan, tiling
from ..kv_write import FP8_CACHE_DTYPES
from .prefix import alibi_window

__all__ = ["varlen_attention", "tile_rows"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _lengths(name: str, lens: Sequence[int]) -> List[int]:
    out = []
    for n in lens:
        if isinstance(n, bool) or int(n) != n or int(n) < 0:
            raise ValueError(f"{name} must hold integers >= 0, got {list(lens)!r}")
        out.append(int(n))
    return out


def tile_rows(q_len: int, k_len: int, heads: int, kv_heads: int, head_size: int,
              elem: int, budget_bytes: int, *, alibi: bool = False) -> int:
    """Query rows of the tiled path's last tile for one causal prompt of ``q_len`` tokens in a
    work dtype of ``elem`` bytes (2: the GPU compute mode in float16/bfloat16; 4: float32),
    under ``budget_bytes`` (``prefill._plan``: the tile size follows the position), at most
    ``q_len``.  ``k_len`` and ``alibi`` do not change it (kept for callers)."""
    work = {2: torch.float16, 4: torch.float32}[elem]
    til = tiling(heads, kv_heads, head_size, 16, work, budget_bytes)
    return min(q_len, til.tile_of(max(0, q_len - 1))[1])


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     q_lens: Sequence[int], scale: float, *,
                     kv_lens: Optional[Sequence[int]] = None, causal: bool = True,
                     alibi_slopes: Optional[torch.Tensor] = None,
                     sliding_window: Optional[int] = None, budget_mb: int = 256,
                     out: Optional[torch.Tensor] = None, kv_cache_dtype: str = "auto",
                     k_scale: ScaleLike = 1.0, v_scale: ScaleLike = 1.0) -> torch.Tensor:
    """Attention of packed sequences; returns ``[T, H, D]`` in the query's dtype.

    ``q_lens``: tokens of each sequence in ``query``; ``kv_lens`` (default ``q_lens``): in
    ``key``/``value``.  ``causal`` needs ``q_lens == kv_lens``; ``sliding_window`` (keys) and
    ``alibi_slopes`` (float, one per query head) only apply to causal attention (the window
    is ignored with ALiBi, as vLLM's ALiBi path does).  ``kv_cache_dtype`` (an fp8 name) with
    ``k_scale``/``v_scale``: the keys and values are rounded through fp8 as the paged cache
    stores them, so that the rows equal the prefix kernel's over that cache.
    """
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError(f"query, key and value must be 3-D [tokens, heads, head_size], got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if query.dtype not in _FLOATS or key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"query, key and value must share one of float32, float16, bfloat16; "
                         f"got {query.dtype}, {key.dtype}, {value.dtype}")
    tokens, heads, dim = query.shape
    kv_heads = key.shape[1]
    if key.shape != value.shape or key.shape[2] != dim:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must match "
                         f"and have head_size {dim}")
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(f"num_heads {heads} must be a multiple of num_kv_heads {kv_heads}")
    qs = _lengths("q_lens", q_lens)
    ks = qs if kv_lens is None else _lengths("kv_lens", kv_lens)
    if len(ks) != len(qs):
        raise ValueError(f"{len(qs)} query sequences but {len(ks)} key sequences")
    if sum(qs) != tokens or sum(ks) != key.shape[0]:
        raise ValueError(f"the lengths cover {sum(qs)} query / {sum(ks)} key tokens; the "
                         f"inputs hold {tokens} / {key.shape[0]}")
    if causal and ks != qs:
        raise ValueError("causal attention needs kv_lens == q_lens")
    if not causal and (alibi_slopes is not None or sliding_window is not None):
        raise ValueError("alibi_slopes and sliding_window apply to causal attention only")
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or int(sliding_window) < 1):
        raise ValueError(f"sliding_window must be an integer >= 1 or None, got "
                         f"{sliding_window!r}")
    slopes = None
    if alibi_slopes is not None:
        if alibi_slopes.dim() != 1 or alibi_slopes.shape[0] != heads:
            raise ValueError(f"alibi_slopes must have shape [{heads}], got "
                             f"{tuple(alibi_slopes.shape)}")
        slopes = alibi_slopes.to(device=query.device, dtype=torch.float32).view(
            kv_heads, heads // kv_heads)
    if budget_mb < 1:
        raise ValueError(f"budget_mb must be >= 1, got {budget_mb!r}")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    fp8 = None
    if kv_cache_dtype != "auto":
        if kv_cache_dtype not in FP8_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; expected "
                             f"'auto' or one of {', '.join(FP8_CACHE_DTYPES)}")
        fp8 = kv_cache_dtype
    window = None if sliding_window is None else int(sliding_window)
    inp = PrefixInputs(query, key, value, None, None, None, scale_factor(scale, "scale"),
                       alibi_window(window, slopes is not None), slopes,
                       k_mult=scale_factor(k_scale, "k_scale") if fp8 else None,
                       v_mult=scale_factor(v_scale, "v_scale") if fp8 else None, fp8=fp8)
    seqs = []
    q0 = k0 = 0
    for q_len, k_len in zip(qs, ks):
        seqs.append(SeqSpan(q0, q_len, 0, None, k0, k_len, causal))
        if not causal and k_len == 0:
            out[q0:q0 + q_len].zero_()  # a query that no key may attend
            seqs.pop()
        q0 += q_len
        k0 += k_len
    attend(inp, seqs, budget_mb << 20, out, forcing().path, causal=causal)
    return out
