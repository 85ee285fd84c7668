"""Kernels layer: pure-PyTorch paged attention and the native decode dispatch.

Nothing in this package imports vLLM; everything takes plain tensors.

- ``paged_decode``: one query token per sequence over its paged KV cache, all sequences
  batched, no host sync (CUDA-graph capturable).
- ``paged_prefix``: chunked prefill / prefix caching (replaces the Triton
  ``context_attention_fwd``), tiled under a memory budget.
- ``dispatch.decode``: the native ``paged_attention_v1/v2`` versus fallback routing.
"""

from .decode import paged_decode
from .prefix import paged_prefix

__all__ = ["paged_decode", "paged_prefix"]
