"""Patching layer: the replacements for vLLM symbols, one module per target module.

Catalogue (each entry — why, how, vLLM versions, upstream status, removal plan — sits in the
docstring of the module that implements it):

- ``vllm.attention.ops.paged_attn.PagedAttention.forward_decode``  -> ``paged_attention.py``
- ``vllm.attention.ops.paged_attn.PagedAttention.forward_prefix``  -> ``paged_attention.py``
- ``vllm.attention.ops.prefix_prefill`` (whole module, import guard) -> ``../import_guard.py``
"""
