"""``xformers.ops.fmha`` of the CPU stand-in: a reference ``memory_efficient_attention_forward``.

Inputs are ``[B, M, H, K]`` (query), ``[B, N, H, K]`` (key, value) or the 5-D ``[B, M, G, H, K]``
form vLLM uses for grouped-query attention (keys already expanded over ``H``).  The result has
the query's shape (last dimension the value's) and dtype (or ``output_dtype``).  The arithmetic
is float32 (float64 for float64 inputs), tiled over queries; a query row that no key may attend
gives zeros.  ``op`` is accepted and ignored (the stand-in has one implementation); dropout
(``p > 0``) is refused.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import attn_bias
from .attn_bias import (
    AttentionBias,
    BlockDiagonalCausalLocalAttentionMask,
    BlockDiagonalCausalMask,
    BlockDiagonalMask,
    LowerTriangularMask,
    LowerTriangularMaskWithTensorBias,
)

#: Bytes of attention scores held at once (per query tile).
TILE_BYTES = 64 << 20


def _as_bmhk(name: str, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() not in (4, 5):
        raise ValueError(f"{name} must be a 4-D [B, M, H, K] or 5-D [B, M, G, H, K] tensor, "
                         f"got {getattr(x, 'shape', x)!r}")
    return x if x.dim() == 4 else x.flatten(2, 3)


def memory_efficient_attention_forward(query: torch.Tensor, key: torch.Tensor,
                                       value: torch.Tensor,
                                       attn_bias: Optional[Union[torch.Tensor,
                                                                 AttentionBias]] = None,
                                       p: float = 0.0, scale: Optional[float] = None, *,
                                       op=None, output_dtype: Optional[torch.dtype] = None
                                       ) -> torch.Tensor:
    if p:
        raise NotImplementedError("the xformers CPU stand-in has no dropout (p must be 0)")
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError(f"query, key and value must have the same rank, got {query.dim()}, "
                         f"{key.dim()}, {value.dim()}")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"query, key and value dtypes differ: {query.dtype}, {key.dtype}, "
                         f"{value.dtype}")
    q, k, v = _as_bmhk("query", query), _as_bmhk("key", key), _as_bmhk("value", value)
    batch, m, heads, dim = q.shape
    n = k.shape[1]
    if k.shape != (batch, n, heads, dim) or v.shape[:3] != (batch, n, heads):
        raise ValueError(f"shapes do not match: query {tuple(query.shape)}, key "
                         f"{tuple(key.shape)}, value {tuple(value.shape)}")
    scale = dim ** -0.5 if scale is None else float(scale)
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32

    tensor_bias = None
    if isinstance(attn_bias, torch.Tensor):
        tensor_bias, structured = attn_bias, None
    elif isinstance(attn_bias, LowerTriangularMaskWithTensorBias):
        tensor_bias, structured = attn_bias._bias, attn_bias
    elif attn_bias is None or isinstance(attn_bias, AttentionBias):
        structured = attn_bias
    else:
        raise TypeError(f"attn_bias must be a tensor or an AttentionBias, got {attn_bias!r}")
    if tensor_bias is not None:
        if tensor_bias.dim() == 5:
            tensor_bias = tensor_bias.flatten(1, 2)
        if tensor_bias.dim() != 4:
            raise ValueError(f"a tensor bias must be [B, H, M, N] (or 5-D), got "
                             f"{tuple(tensor_bias.shape)}")
        tensor_bias = tensor_bias.expand(batch, heads, m, n)

    if isinstance(structured, BlockDiagonalMask):
        if batch != 1:
            raise ValueError(f"a BlockDiagonalMask needs batch size 1, got {batch}")
        if (structured.q_seqinfo.seqstart_py[-1] != m
                or structured.k_seqinfo.seqstart_py[-1] != n):
            raise ValueError(f"the mask packs {structured.q_seqinfo.seqstart_py[-1]} queries "
                             f"and {structured.k_seqinfo.seqstart_py[-1]} keys, the inputs "
                             f"hold {m} and {n}")
        segments = [(0, q0, q1, k0, k1) for q0, q1, k0, k1 in structured.blocks()]
    else:
        segments = [(b, 0, m, 0, n) for b in range(batch)]

    out = torch.zeros(batch, m, heads, v.shape[-1], dtype=compute, device=query.device)
    for b, q0, q1, k0, k1 in segments:
        if q1 == q0:
            continue
        keys = k[b, k0:k1].to(compute).transpose(0, 1)        # [H, nk, K]
        values = v[b, k0:k1].to(compute).transpose(0, 1)      # [H, nk, Kv]
        cols = torch.arange(k1 - k0, device=query.device)
        step = max(1, TILE_BYTES // max(1, heads * (k1 - k0) * keys.element_size()))
        for t0 in range(q0, q1, step):
            t1 = min(q1, t0 + step)
            scores = (q[b, t0:t1].to(compute).transpose(0, 1) @ keys.transpose(1, 2)) * scale
            if tensor_bias is not None:
                scores += tensor_bias[b, :, t0:t1, k0:k1].to(compute)
            if structured is not None:
                allowed = structured._allowed(torch.arange(t0 - q0, t1 - q0,
                                                           device=query.device), cols)
                if allowed is not None:
                    scores.masked_fill_(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(nan=0.0)
            out[b, t0:t1] = (probs @ values).transpose(0, 1)
    result = out.to(output_dtype or query.dtype)
    if query.dim() == 5:
        result = result.unflatten(2, query.shape[2:4])
    return result


def memory_efficient_attention(query, key, value, attn_bias=None, p: float = 0.0,
                               scale: Optional[float] = None, *, op=None,
                               output_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Forward only (the stand-in has no backward)."""
    return memory_efficient_attention_forward(query, key, value, attn_bias, p, scale, op=op,
                                              output_dtype=output_dtype)


__all__ = ["attn_bias", "AttentionBias", "BlockDiagonalMask", "BlockDiagonalCausalMask",
           "BlockDiagonalCausalLocalAttentionMask", "LowerTriangularMask",
           "LowerTriangularMaskWithTensorBias", "memory_efficient_attention",
           "memory_efficient_attention_forward", "TILE_BYTES"]
