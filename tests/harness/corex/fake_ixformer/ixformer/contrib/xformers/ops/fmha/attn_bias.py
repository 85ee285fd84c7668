"""Fake ``ixformer.contrib.xformers.ops.fmha.attn_bias``: the biases the vendor backend takes
from ixformer (the stand-in's xformers classes, so their semantics are xformers')."""

from xformers.ops.fmha.attn_bias import (  # noqa: F401
    AttentionBias,
    BlockDiagonalCausalLocalAttentionMask,
    BlockDiagonalCausalMask,
    BlockDiagonalMask,
    LowerTriangularMask,
    LowerTriangularMaskWithTensorBias,
)

__all__ = ["AttentionBias", "BlockDiagonalCausalLocalAttentionMask", "BlockDiagonalCausalMask",
           "BlockDiagonalMask", "LowerTriangularMask", "LowerTriangularMaskWithTensorBias"]
