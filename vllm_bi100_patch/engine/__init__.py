"""Engine: vLLM 0.6.3's engine bugs, fixed where they are made.

Owns the rows for the block table of a chunk past its cached prefix (``block_tables``), the
empty logits of tensor-parallel workers (``logits_gather``), a stream's delta
(``stream_delta``) and MRoPE positions (``mrope_positions``).

May import: ``activation`` and ``patching`` (code shapes, the factory helpers).  Never
``attention``, ``serving`` or ``ops``, and never vLLM.  A new engine row: its factory here, its
``Patch`` in ``patching/table.py``, its code shapes checked with ``patching.code_shapes``.
"""
