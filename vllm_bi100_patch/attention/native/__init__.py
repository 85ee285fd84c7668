"""The native decoder: vLLM's ``paged_attention_v1/v2`` where they exist and are safe, else
the pure-PyTorch ``kernels.paged_decode``.

Between the patch layer (``attention/paged_attention.py``, which turns vLLM's arguments into one
``DecodeCall``) and the kernels (pure PyTorch, no vLLM names).  Never imports vLLM.

- ``probe.py``: what an ops module's kernels are (present or stubbed, calling convention);
- ``calls.py``: ``DecodeCall`` (vLLM's arguments, checked) and one explicit call function per
  calling convention;
- ``limits.py``: the routing parameters, V1's length limit and the BI-V100 occupancy rule;
- ``routes.py``: ``RouteTable`` (one per ops profile and routing): the facts of a call, the
  route entries and kernel rules, the choice, why a kernel cannot take a call, ``describe()``;
- ``longest.py``: the longest sequence of a call without syncs that matter, and the check that
  ``max_seq_len`` bounds it;
- ``decoder.py``: ``NativeDecoder`` (one per ops module and routing): the ops object, the route
  counters, ``decode`` and the kernel call;
- ``scratch.py``: the V2 scratch buffers.

``routes`` and ``decoder`` never import each other: ``build`` (here) gives a decoder its route
table; the decoder asks the table for a route, the table never sees the decoder.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable, Union

from .calls import DecodeCall, check_head_mapping, check_shapes
from ..kernels import DEFAULT_BUDGET_MB
from .decoder import NativeDecoder, reset_route_counts, route_counts, scratch_bytes
from .probe import OpsProfile, compiled_kernels_missing
from .routes import (ILUVATAR_V1_MAX_SEQ_LEN, NATIVE_HEAD_SIZES, STOCK_V1_MAX_SEQ_LEN, RouteTable,
                     Routing)

__all__ = ["DecodeCall", "ILUVATAR_V1_MAX_SEQ_LEN", "NATIVE_HEAD_SIZES", "NativeDecoder",
           "RouteTable", "Routing", "STOCK_V1_MAX_SEQ_LEN", "build", "check_head_mapping",
           "check_shapes", "compiled_kernels_missing", "for_module", "reset_route_counts",
           "route_counts", "scratch_bytes"]


def build(ops: Any, routing: Union[Routing, Callable[[], Routing]],
          budget_mb: int = DEFAULT_BUDGET_MB) -> NativeDecoder:
    """The decoder of ``ops`` (None: no native ops) under ``routing`` (or the function that
    makes it, called on first use): its probe, its route table, the decoder (its fallback's
    working set per call: ``budget_mb``)."""
    return NativeDecoder(ops, RouteTable(OpsProfile(ops) if ops is not None else None, routing),
                         budget_mb)


def for_module(module: types.ModuleType, routing: Union[Routing, Callable[[], Routing]],
               ixformer: bool, budget_mb: int = DEFAULT_BUDGET_MB) -> NativeDecoder:
    """The decoder for the ops a vLLM attention module calls (its ``ops``, else
    ``vllm._custom_ops`` if imported); no native ops where those have no compiled kernels
    behind them (``probe.compiled_kernels_missing``)."""
    ops = vars(module).get("ops")
    if ops is None:
        ops = sys.modules.get("vllm._custom_ops")
    if ops is not None and compiled_kernels_missing(ops, ixformer) is not None:
        ops = None
    return build(ops, routing, budget_mb)
