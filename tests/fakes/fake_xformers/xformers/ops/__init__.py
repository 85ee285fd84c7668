"""``xformers.ops`` of the CPU stand-in: the memory-efficient attention entry points."""

from . import fmha
from .fmha import (
    AttentionBias,
    LowerTriangularMask,
    LowerTriangularMaskWithTensorBias,
    memory_efficient_attention,
    memory_efficient_attention_forward,
)

__all__ = ["fmha", "AttentionBias", "LowerTriangularMask", "LowerTriangularMaskWithTensorBias",
           "memory_efficient_attention", "memory_efficient_attention_forward"]
