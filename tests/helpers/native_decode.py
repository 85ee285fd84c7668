"""Decode through the native decoder as the patch layer drives it: vLLM's ``forward_decode``
arguments normalised by ``patches.paged_attention.decode_call``, then ``NativeDecoder.decode``
of one decoder per (ops object, routing), kept with its ops for the test (as a patch keeps
the decoder it built)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from vllm_bi100_patch.attention import native
from vllm_bi100_patch.attention.native import NativeDecoder, Routing
from vllm_bi100_patch.attention.paged_attention import decode_call

_PARAMS = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "max_seq_len",
           "kv_cache_dtype", "num_kv_heads", "scale", "alibi_slopes")
_decoders: Dict[Tuple[int, Routing], Tuple[Any, NativeDecoder]] = {}


def decoder_for(ops: Any, routing: Optional[Routing] = None) -> NativeDecoder:
    """The decoder of ``ops`` under ``routing`` (built once, like the patch's)."""
    routing = routing or Routing()
    entry = _decoders.get((id(ops), routing))
    if entry is None or entry[0] is not ops:
        entry = _decoders[(id(ops), routing)] = (ops, native.build(ops, routing))
    return entry[1]


def forget() -> None:
    _decoders.clear()


def decode(*args: Any, ops: Any, routing: Routing, **named: Any) -> Any:
    """``forward_decode``'s leading arguments positionally, the rest (``k_scale``,
    ``tp_rank``, ...) by name."""
    values = dict(zip(_PARAMS, args), **named)
    return decoder_for(ops, routing).decode(decode_call(values))


def describe(ops: Any, routing: Optional[Routing] = None) -> Dict[str, Any]:
    return decoder_for(ops, routing).describe()
