"""Test stand-in for Iluvatar's ``ixformer`` 0.4.0+corex.3.2.3 (never shipped in the wheel).

Only what the CoreX 3.2.3 vLLM build reaches through ``vllm._custom_ops`` for paged
attention is modelled (``docs/corex-3.2.3.md`` lists each fact and its public source).  The
kernels are CPU reference implementations on vLLM's real cache layout, so outputs can be
checked, and they enforce the BI-V100's hazards instead of hanging a card:

- ``vllm_single_query_cached_kv_attention`` (paged attention V1) raises ``BI100Hang`` for a
  ``max_context_len`` above 32,768 (on the card: shared-memory logits, a hang) and for a
  sequence longer than the ``max_context_len`` it was given;
- there is no V2 kernel and no ``swap_blocks`` (CoreX 3.2.3's ixformer has
  ``vllm_swap_blocks(src, dst, mapping)`` taking a dict instead).
"""

__version__ = "0.4.0+corex.3.2.3"
