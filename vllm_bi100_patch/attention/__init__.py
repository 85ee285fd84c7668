"""Attention: everything that touches vLLM's attention and KV cache.

Owns the rows for ``PagedAttention`` (``paged_attention``: decode and prefix), dense prefill
(``dense_prefill``), KV block moves and cache writes (``kv_blocks``, ``kv_write``), the import
guard that keeps vLLM's Triton prefix kernel out (``import_guard``), the native decoder
(``native/``: vendor kernels where safe, its routing and settings) and the kernels
(``kernels/``: pure PyTorch, a leaf that imports only torch and the package logger).

May import: ``activation``, ``patching`` and torch.  Never ``engine``, ``serving`` or
``ops``, and never vLLM (the target module is handed in).  A new attention row: its factory
here, its ``Patch`` in ``patching/table.py``; a new kernel: ``kernels/`` (no vLLM names).
"""
