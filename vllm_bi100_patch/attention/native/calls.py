"""The typed decode call and the calling conventions of the native kernels.

``DecodeCall`` is what the patch wrapper makes of vLLM's ``forward_decode`` arguments, once
per call (``head_mapping`` versus ``num_kv_heads`` settled there: ``num_kv_heads`` is always
the cache's KV head count, ``head_mapping`` the tensor vLLM passed in its place, if it did).

A ``Convention`` is one build's parameter list (``docs/corex-3.2.3.md``) and an explicit
function that calls a kernel with it, positionally:

- ``stock``: ``paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale,
  block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale,
  v_scale, tp_rank, blocksparse_*x4)``; V2 takes ``exp_sum, max_logits, tmp_out`` after
  ``out``;
- ``kv_scale``: vLLM 0.5.0 - 0.5.2, one ``kv_scale`` where the stock list has two scales;
- ``vendor``: Iluvatar CoreX 3.2.3's V1, ``paged_attention_v1(output, query, key_cache,
  value_cache, head_mapping, scale, block_tables, context_lens, block_size, max_context_len,
  alibi_slopes=None, kv_cache_dtype=None)``: called with the first 11, as its own build does
  (``kv_cache_dtype`` is ignored there, so only ``"auto"`` caches are ever routed to it).

A kernel whose signature ends early (e.g. without the blocksparse parameters) is called with
the arguments it has; the probe (``probe.py``) says which convention a kernel matches.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

from ..kernels.cache import as_count

__all__ = ["CONVENTIONS", "Convention", "DecodeCall", "check_head_mapping", "check_shapes"]

Scratch = Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class DecodeCall:
    """One decode call, in the native kernels' terms (see the module docstring)."""

    __slots__ = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "max_seq_len",
                 "kv_cache_dtype", "num_kv_heads", "head_mapping", "scale", "alibi_slopes",
                 "k_scale", "v_scale", "kv_scale", "tp_rank", "blocksparse", "block_size")

    def __init__(self, query: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, max_seq_len: int, kv_cache_dtype: str,
                 num_kv_heads: int, head_mapping: Optional[torch.Tensor], scale: float,
                 alibi_slopes: Optional[torch.Tensor], k_scale: Any, v_scale: Any,
                 kv_scale: Any, tp_rank: int, blocksparse: Tuple[int, int, int, int]) -> None:
        self.query, self.key_cache, self.value_cache = query, key_cache, value_cache
        self.block_tables, self.seq_lens, self.max_seq_len = block_tables, seq_lens, max_seq_len
        self.kv_cache_dtype, self.num_kv_heads = kv_cache_dtype, num_kv_heads
        self.head_mapping, self.scale, self.alibi_slopes = head_mapping, scale, alibi_slopes
        self.k_scale, self.v_scale, self.kv_scale = k_scale, v_scale, kv_scale
        self.tp_rank, self.blocksparse = tp_rank, blocksparse
        self.block_size = int(value_cache.shape[3])

    @classmethod
    def checked(cls, query: Any, key_cache: Any, value_cache: Any, block_tables: Any,
                seq_lens: Any, max_seq_len: Any, kv_cache_dtype: str, num_kv_heads: Any,
                scale: float, alibi_slopes: Optional[torch.Tensor], k_scale: Any, v_scale: Any,
                kv_scale: Any, tp_rank: int, blocksparse: Tuple[int, int, int, int]
                ) -> "DecodeCall":
        """The call of vLLM's arguments, checked from metadata only (no device read): the
        tensors' ranks (``check_shapes``), ``num_kv_heads`` as an int matching the cache or a
        ``head_mapping`` tensor (``check_head_mapping``), ``max_seq_len`` an int >= 0;
        ValueError naming the argument otherwise."""
        check_shapes(query, key_cache, value_cache, block_tables, seq_lens)
        kv_heads = int(key_cache.shape[1])
        head_mapping = check_head_mapping(num_kv_heads, query, kv_heads)
        return cls(query, key_cache, value_cache, block_tables, seq_lens,
                   as_count("max_seq_len", max_seq_len), kv_cache_dtype, kv_heads, head_mapping,
                   scale, alibi_slopes, k_scale, v_scale, kv_scale, tp_rank, blocksparse)

    @property
    def is_blocksparse(self) -> bool:
        stride = self.blocksparse[1]
        return stride is not None and stride > 1


_RANKS = (("query", 3, "[num_seqs, num_heads, head_size]"),
          ("key_cache", 5, "[num_blocks, num_kv_heads, head_size // x, block_size, x]"),
          ("value_cache", 4, "[num_blocks, num_kv_heads, head_size, block_size]"),
          ("block_tables", 2, "[num_seqs, max_blocks_per_seq]"),
          ("seq_lens", 1, "[num_seqs]"))


def check_shapes(*tensors: Any) -> None:
    """``query, key_cache, value_cache, block_tables, seq_lens`` are tensors of the ranks
    vLLM passes; else ValueError naming the argument (metadata only: no device read)."""
    q, k, v, b, n = tensors
    t = torch.Tensor
    if isinstance(q, t) and isinstance(k, t) and isinstance(v, t) and isinstance(b, t) and \
            isinstance(n, t) and q.dim() == 3 and k.dim() == 5 and v.dim() == 4 and \
            b.dim() == 2 and n.dim() == 1:
        return  # the common case, without building messages
    for (name, rank, layout), t in zip(_RANKS, tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a {rank}-D tensor {layout}, got "
                             f"{type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")


def check_head_mapping(num_kv_heads: Any, query: torch.Tensor, kv_heads: int
                       ) -> Optional[torch.Tensor]:
    """``num_kv_heads`` as vLLM passed it: an int that must match the cache's ``kv_heads``
    (returns None), or the ``head_mapping`` tensor Iluvatar's XFormers backend passes in its
    place (returned): 1-D int32/int64, one entry per query head, on the query's device.
    Checked from metadata only (no device read); ValueError naming the argument otherwise."""
    num_heads = int(query.shape[1])
    if isinstance(num_kv_heads, torch.Tensor):
        if num_kv_heads.dim() != 1 or num_kv_heads.shape[0] != num_heads or \
                num_kv_heads.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                "num_kv_heads was passed as a head_mapping tensor, which must be 1-D int32/int64 "
                f"with one entry per query head ({num_heads}); got shape "
                f"{tuple(num_kv_heads.shape)}, dtype {num_kv_heads.dtype}")
        if num_kv_heads.device != query.device:
            raise ValueError(
                f"num_kv_heads was passed as a head_mapping tensor on {num_kv_heads.device}, "
                f"but the query is on {query.device}: a kernel cannot read it there (moving it "
                "would copy between devices on every call; build it on the query's device)")
        return num_kv_heads
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int):
        raise ValueError(f"num_kv_heads must be an int or a head_mapping tensor, got "
                         f"{type(num_kv_heads).__name__} {num_kv_heads!r}")
    if num_kv_heads != kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} does not match the cache's "
                         f"{kv_heads} KV heads")
    return None


Invoke = Callable[[Callable[..., Any], int, DecodeCall, torch.Tensor, Scratch,
                   Optional[torch.Tensor]], None]


def _stock(func: Callable[..., Any], nargs: int, c: DecodeCall, out: torch.Tensor,
           scratch: Scratch, head_mapping: Optional[torch.Tensor]) -> None:
    scales = (c.k_scale, c.v_scale)
    _call(func, nargs, out, scratch, (c.query, c.key_cache, c.value_cache, c.num_kv_heads,
                                      c.scale, c.block_tables, c.seq_lens, c.block_size,
                                      c.max_seq_len, c.alibi_slopes, c.kv_cache_dtype, *scales,
                                      c.tp_rank, *c.blocksparse))


def _kv_scale(func: Callable[..., Any], nargs: int, c: DecodeCall, out: torch.Tensor,
              scratch: Scratch, head_mapping: Optional[torch.Tensor]) -> None:
    if c.kv_scale is None:
        raise TypeError("this build's native decode takes one kv_scale (vLLM 0.5.0 - 0.5.2), "
                        "but vLLM passed k_scale and v_scale")
    _call(func, nargs, out, scratch, (c.query, c.key_cache, c.value_cache, c.num_kv_heads,
                                      c.scale, c.block_tables, c.seq_lens, c.block_size,
                                      c.max_seq_len, c.alibi_slopes, c.kv_cache_dtype,
                                      c.kv_scale, c.tp_rank, *c.blocksparse))


def _vendor(func: Callable[..., Any], nargs: int, c: DecodeCall, out: torch.Tensor,
            scratch: Scratch, head_mapping: Optional[torch.Tensor]) -> None:
    _call(func, nargs, out, scratch, (c.query, c.key_cache, c.value_cache, head_mapping,
                                      c.scale, c.block_tables, c.seq_lens, c.block_size,
                                      c.max_seq_len, c.alibi_slopes))


def _call(func: Callable[..., Any], nargs: int, out: torch.Tensor, scratch: Scratch,
          args: Sequence[Any]) -> None:
    head = (out,) if scratch is None else (out, *scratch)
    func(*(head + tuple(args))[:nargs])


def call_unreadable(func: Callable[..., Any], c: DecodeCall, out: torch.Tensor,
                    scratch: Scratch) -> None:
    """A kernel whose parameters cannot be read (a builtin, ``*args``): every stock argument
    in the stock order (the ``kv_scale`` list in the family that has it)."""
    call = _kv_scale if c.kv_scale is not None else _stock
    call(func, 10 ** 6, c, out, scratch, None)


class Convention:
    """A parameter list (``lead`` required, then ``tail`` passed as far as the kernel has it)
    and the function that calls a kernel with it."""

    def __init__(self, name: str, lead: Tuple[str, ...], tail: Tuple[str, ...],
                 invoke: Invoke, scales: Optional[str] = None, head_mapping: bool = False
                 ) -> None:
        self.name, self.lead, self.tail = name, lead, tail
        self.invoke = invoke
        self.head_mapping = head_mapping
        #: feature -> the parameter that brings it (a kernel without it lacks the feature)
        self.features = {"scales": scales, "kv_cache_dtype": "kv_cache_dtype" if scales else None,
                         "blocksparse": "blocksparse_head_sliding_step"}

    def match(self, names: Sequence[str]) -> Optional[int]:
        """How many positional arguments to pass to a kernel with these positional parameter
        names; None when they do not start with this convention's required ones."""
        if tuple(names[:len(self.lead)]) != self.lead:
            return None
        n = len(self.lead)
        for want, got in zip(self.tail, names[n:]):
            if want != got:
                break
            n += 1
        return n

    def takes(self, nargs: int) -> Dict[str, bool]:
        """Which features a kernel given ``nargs`` arguments receives."""
        given = set((self.lead + self.tail)[:nargs])
        return {feature: param in given for feature, param in self.features.items()}


_BLOCKSPARSE = ("blocksparse_local_blocks", "blocksparse_vert_stride", "blocksparse_block_size",
                "blocksparse_head_sliding_step")
_STOCK = ("query", "key_cache", "value_cache", "num_kv_heads", "scale", "block_tables",
          "seq_lens", "block_size", "max_seq_len", "alibi_slopes", "kv_cache_dtype")
_V2 = ("out", "exp_sum", "max_logits", "tmp_out")

#: The conventions a kernel may match, tried in order, per kernel.
CONVENTIONS: Dict[str, Tuple[Convention, ...]] = {
    "v1": (
        Convention("stock", ("out",) + _STOCK + ("k_scale", "v_scale"),
                   ("tp_rank",) + _BLOCKSPARSE, _stock, "v_scale"),
        Convention("kv_scale", ("out",) + _STOCK + ("kv_scale",), ("tp_rank",) + _BLOCKSPARSE,
                   _kv_scale, "kv_scale"),
        Convention("vendor", ("output", "query", "key_cache", "value_cache", "head_mapping",
                              "scale", "block_tables", "context_lens", "block_size",
                              "max_context_len"), ("alibi_slopes",), _vendor,
                   head_mapping=True),
    ),
    "v2": (
        Convention("stock", _V2 + _STOCK + ("k_scale", "v_scale"), ("tp_rank",) + _BLOCKSPARSE,
                   _stock, "v_scale"),
        Convention("kv_scale", _V2 + _STOCK + ("kv_scale",), ("tp_rank",) + _BLOCKSPARSE,
                   _kv_scale, "kv_scale"),
    ),
}
