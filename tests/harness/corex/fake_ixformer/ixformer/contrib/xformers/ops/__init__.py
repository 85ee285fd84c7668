"""Fake ``ixformer.contrib.xformers.ops`` (see the package docstring)."""

from . import fmha
from .fmha import BI100FlashError, HEAD_SIZE_LIMIT, memory_efficient_attention_forward

__all__ = ["fmha", "BI100FlashError", "HEAD_SIZE_LIMIT", "memory_efficient_attention_forward"]
