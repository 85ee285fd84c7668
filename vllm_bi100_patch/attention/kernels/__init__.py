"""Kernels layer: pure-PyTorch paged attention, a leaf: it imports only torch and the package
logger, knows no vLLM parameter names, and everything takes plain tensors.  The native decode
kernels and the routing between them and these live in ``vllm_bi100_patch.attention.native``.

- ``paged_decode``: one query token per sequence over its paged KV cache, all sequences
  batched, no host sync (CUDA-graph capturable), each row independent of its batch mates
  (fixed absolute tiles), passes under a memory budget.
- ``paged_prefix``: chunked prefill / prefix caching (replaces the Triton
  ``context_attention_fwd``), tiled under a memory budget.
"""

from .decode import DEFAULT_BUDGET_MB, paged_decode
from .prefill import paged_prefix

__all__ = ["DEFAULT_BUDGET_MB", "paged_decode", "paged_prefix"]
