"""Fake ``ixformer.contrib.xformers.ops.fmha``: the forward with the BI-V100 hazards."""

from __future__ import annotations

import torch
from xformers.ops import fmha as _reference

from ixformer.functions import CALLS, _count

from . import attn_bias, flash
from .attn_bias import AttentionBias, LowerTriangularMaskWithTensorBias

#: Largest head size Iluvatar's flash attention computes correctly (field notes).
HEAD_SIZE_LIMIT = 128

__all__ = ["attn_bias", "flash", "BI100FlashError", "HEAD_SIZE_LIMIT", "CALLS",
           "memory_efficient_attention_forward"]


class BI100FlashError(RuntimeError):
    """Iluvatar's flash attention refusing a causal call above head size 128."""


def memory_efficient_attention_forward(query, key, value, attn_bias=None, p=0.0, scale=None,
                                       *, op=None, output_dtype=None):
    """xformers' forward with ixformer's grouped-query convention and the hazards."""
    _count("contrib.xformers.memory_efficient_attention_forward")
    head_size = query.shape[-1]
    if head_size > HEAD_SIZE_LIMIT:
        if isinstance(attn_bias, AttentionBias) and attn_bias._causal \
                and not isinstance(attn_bias, LowerTriangularMaskWithTensorBias):
            raise BI100FlashError(f"flash attention forward: causal attention with head size "
                                  f"{head_size} > {HEAD_SIZE_LIMIT} is not supported")
        _count("contrib.xformers.garbage")
        shape = query.shape[:-1] + (value.shape[-1],)
        return torch.zeros(shape, dtype=output_dtype or query.dtype, device=query.device)
    if query.dim() == 4 and key.shape[2] != query.shape[2]:
        group = query.shape[2] // key.shape[2]
        key = key.repeat_interleave(group, dim=2)
        value = value.repeat_interleave(group, dim=2)
    return _reference.memory_efficient_attention_forward(query, key, value, attn_bias, p, scale,
                                                         op=op, output_dtype=output_dtype)
