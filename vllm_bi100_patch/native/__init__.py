"""The native decoder: vLLM's ``paged_attention_v1/v2`` where they exist and are safe, else
the pure-PyTorch ``kernels.paged_decode``.

Between the patch layer (``patches/paged_attention.py``, which turns vLLM's arguments into one
``DecodeCall``) and the kernels (pure PyTorch, no vLLM names).  Never imports vLLM.

- ``probe.py``: what an ops module's kernels are (present or stubbed, calling convention);
- ``calls.py``: ``DecodeCall`` and one explicit call function per calling convention;
- ``routes.py``: the route table that both the per-call choice and ``describe()`` read, V1's
  length limit and the BI-V100 occupancy rule;
- ``decoder.py``: ``NativeDecoder`` (one per ops module and routing), the route counters and
  the ``max_seq_len`` check;
- ``scratch.py``: the V2 scratch buffers.
"""

from .calls import DecodeCall, check_head_mapping, check_shapes
from .decoder import NativeDecoder, reset_route_counts, route_counts, scratch_bytes
from .probe import compiled_kernels_missing
from .routes import ILUVATAR_V1_MAX_SEQ_LEN, NATIVE_HEAD_SIZES, STOCK_V1_MAX_SEQ_LEN, Routing

__all__ = ["DecodeCall", "ILUVATAR_V1_MAX_SEQ_LEN", "NATIVE_HEAD_SIZES", "NativeDecoder",
           "Routing", "STOCK_V1_MAX_SEQ_LEN", "check_head_mapping", "check_shapes",
           "compiled_kernels_missing", "reset_route_counts", "route_counts", "scratch_bytes"]
