"""Dense varlen attention for prompts without a block table, in pure PyTorch.

What vLLM's XFormers backend computes in ``_run_memory_efficient_xformers_forward``: several
prompts packed along the token axis (``query [T, H, D]``, ``key``/``value`` ``[T, KV, D]``),
each attending only to itself, causal (decoder self-attention) or not (encoder and
encoder/decoder cross-attention), with grouped-query heads (query head ``h`` reads KV head
``h // (H // KV)``), an optional sliding window (query ``i`` sees keys ``i - window < j <= i``,
xformers' local attention) and optional ALiBi slopes (bias ``slope[h] * (j - i)``, vLLM's
``_make_alibi_bias``).

Work is tiled over queries: a tile's scores, its mask and its converted K/V span stay under
``budget_mb`` (the budget the prefix kernel uses; at least one query row per tile).  Scores,
softmax and accumulation are float32; the matrix products run in float32 or in the inputs'
dtype as ``_common.compute_mode`` says.  Inputs are never written.  Never imports vLLM.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ._common import compute_mode, scores_bmm, work_dtype

__all__ = ["varlen_attention", "tile_rows"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _lengths(name: str, lens: Sequence[int]) -> List[int]:
    out = []
    for n in lens:
        if isinstance(n, bool) or int(n) != n or int(n) < 0:
            raise ValueError(f"{name} must hold integers >= 0, got {list(lens)!r}")
        out.append(int(n))
    return out


def tile_rows(q_len: int, k_len: int, heads: int, kv_heads: int, head_size: int,
              elem: int, budget_bytes: int) -> int:
    """Query rows per tile so that one tile's working set stays under ``budget_bytes``:
    float32 scores (plus a bias or probability copy), the bool mask and its negation per
    (query, key) pair, the query/output rows in float32, and the K/V span converted to
    float32 (counted once)."""
    per_row = heads * k_len * (4 + 4 + elem) + 2 * k_len + 2 * heads * head_size * 4
    fixed = 2 * k_len * kv_heads * head_size * 4
    return max(1, min(q_len, (budget_bytes - fixed) // per_row))


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     q_lens: Sequence[int], scale: float, *,
                     kv_lens: Optional[Sequence[int]] = None, causal: bool = True,
                     alibi_slopes: Optional[torch.Tensor] = None,
                     sliding_window: Optional[int] = None, budget_mb: int = 256,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of packed sequences; returns ``[T, H, D]`` in the query's dtype.

    ``q_lens``: tokens of each sequence in ``query``; ``kv_lens`` (default ``q_lens``): in
    ``key``/``value``.  ``causal`` needs ``q_lens == kv_lens``; ``sliding_window`` (keys) and
    ``alibi_slopes`` (float, one per query head) only apply to causal attention.
    """
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError(f"query, key and value must be 3-D [tokens, heads, head_size], got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if query.dtype not in _FLOATS or key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"query, key and value must share one of float32, float16, bfloat16; "
                         f"got {query.dtype}, {key.dtype}, {value.dtype}")
    tokens, heads, dim = query.shape
    kv_heads = key.shape[1]
    if key.shape != value.shape or key.shape[2] != dim:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must match "
                         f"and have head_size {dim}")
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(f"num_heads {heads} must be a multiple of num_kv_heads {kv_heads}")
    qs = _lengths("q_lens", q_lens)
    ks = qs if kv_lens is None else _lengths("kv_lens", kv_lens)
    if len(ks) != len(qs):
        raise ValueError(f"{len(qs)} query sequences but {len(ks)} key sequences")
    if sum(qs) != tokens or sum(ks) != key.shape[0]:
        raise ValueError(f"the lengths cover {sum(qs)} query / {sum(ks)} key tokens; the "
                         f"inputs hold {tokens} / {key.shape[0]}")
    if causal and ks != qs:
        raise ValueError("causal attention needs kv_lens == q_lens")
    if not causal and (alibi_slopes is not None or sliding_window is not None):
        raise ValueError("alibi_slopes and sliding_window apply to causal attention only")
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or int(sliding_window) < 1):
        raise ValueError(f"sliding_window must be an integer >= 1 or None, got "
                         f"{sliding_window!r}")
    slopes = None
    if alibi_slopes is not None:
        if alibi_slopes.dim() != 1 or alibi_slopes.shape[0] != heads:
            raise ValueError(f"alibi_slopes must have shape [{heads}], got "
                             f"{tuple(alibi_slopes.shape)}")
        slopes = alibi_slopes.to(device=query.device, dtype=torch.float32).view(
            kv_heads, heads // kv_heads, 1, 1)
    if budget_mb < 1:
        raise ValueError(f"budget_mb must be >= 1, got {budget_mb!r}")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    work = work_dtype(query.dtype, query.device)
    native = compute_mode(query.device) == "native"
    elem = torch.empty((), dtype=work).element_size()
    window = None if sliding_window is None else int(sliding_window)
    q0 = k0 = 0
    for q_len, k_len in zip(qs, ks):
        rows = tile_rows(q_len, k_len, heads, kv_heads, dim, elem, budget_mb << 20)
        for c0 in range(0, q_len, rows):
            c1 = min(q_len, c0 + rows)
            lo, hi = (0, k_len) if not causal else (
                0 if window is None else max(0, c0 - window + 1), c1)
            _tile(query[q0 + c0:q0 + c1], key[k0 + lo:k0 + hi], value[k0 + lo:k0 + hi],
                  out[q0 + c0:q0 + c1], c0, lo, scale, causal, window, slopes, work, native)
        q0 += q_len
        k0 += k_len
    return out


def _tile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dest: torch.Tensor, q_pos: int,
          k_pos: int, scale: float, causal: bool, window: Optional[int],
          slopes: Optional[torch.Tensor], work: torch.dtype, native: bool) -> None:
    """One query tile: ``q`` [n, H, D] at positions ``q_pos..``, keys at ``k_pos..``."""
    n, heads, dim = q.shape
    nk, kv_heads = k.shape[0], k.shape[1]
    if nk == 0:  # a query that no key may attend (cross-attention to an empty encoder input)
        dest.zero_()
        return
    group = heads // kv_heads
    # [KV, group * n, D]: the query heads of one KV head side by side (h = kv * group + g).
    qt = q.to(work).permute(1, 0, 2).reshape(kv_heads, group * n, dim)
    kt = k.to(work).permute(1, 2, 0)                    # [KV, D, nk]
    vt = v.to(work).permute(1, 0, 2)                    # [KV, nk, D]
    scores = scores_bmm(qt, kt).view(kv_heads, group, n, nk)
    scores.mul_(scale)
    if causal:
        qi = torch.arange(q_pos, q_pos + n, device=q.device)[:, None]
        kj = torch.arange(k_pos, k_pos + nk, device=q.device)[None, :]
        if slopes is not None:
            scores.add_(slopes * (kj - qi).to(torch.float32))
        hidden = kj > qi
        if window is not None:
            hidden |= kj <= qi - window
        scores.masked_fill_(hidden, float("-inf"))
        del hidden
    scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()
    scores.div_(scores.sum(dim=-1, keepdim=True))
    probs = scores.view(kv_heads, group * n, nk)
    if native:
        res = torch.bmm(probs.to(work), vt)
    else:
        res = torch.bmm(probs, vt)
    dest.copy_(res.view(heads, n, dim).transpose(0, 1))
