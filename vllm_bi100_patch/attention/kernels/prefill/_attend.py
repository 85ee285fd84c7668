"""The one driver of the prefix and dense kernels: which path each query row takes.

``paged_prefix`` (new tokens after a cached context) and ``dense.varlen_attention`` (a prompt
without a cache: the context is empty) describe their sequences as ``SeqSpan``s and call
``attend``: a prompt computed in one call by the dense kernel and the same rows computed by
the prefix kernel after a cache hit go through the same code with the same operands.

Path per row, never per call: on CPU (SDPA allowed: float32/bfloat16, no ALiBi, a float
scale, a verified torch) rows whose SDPA tile (absolute, ``SDPA_QUERY_TILE`` positions)
ends where its K/V still fit the budget (``prefill._plan.sdpa_max_end``) take SDPA, the others
the tiled path; everything else takes the tiled path.  ``forced(path="sdpa"/"tiled")``
(``kernels.forced``; its callers pass it as ``force``) overrides it for tests and the benchmark.
"""

from __future__ import annotations

from typing import Iterable, Optional, Set

import torch

from ....activation.log import log
from ..compute import compute_mode, work_dtype
from ._plan import (
    PrefixInputs,
    SeqSpan,
    Tiling,
    minimum_working_set,
    sdpa_max_end,
    sdpa_path_ok,
    tiling,
    window_keys,
)
from ._sdpa import sdpa_rows
from ._tiled import TiledRunner

__all__ = ["PrefixStats", "attend"]

_warned: Set[tuple] = set()


class PrefixStats:
    """What one ``paged_prefix`` call did, filled in when the caller passes one as ``stats``
    (the kernel keeps no state and reports to nobody; the shim's patch layer counts it):
    sequences, new tokens and cached context tokens per path (``"sdpa"``, ``"tiled"``; a
    sequence whose rows took both paths counts once on each), and sequences with rows past
    the work dtype's range that ran again in float32."""

    __slots__ = ("sequences", "tokens", "context", "fp32_reruns")

    def __init__(self) -> None:
        self.sequences = {"sdpa": 0, "tiled": 0}
        self.tokens = {"sdpa": 0, "tiled": 0}
        self.context = {"sdpa": 0, "tiled": 0}
        self.fp32_reruns = 0

    def record(self, seq: SeqSpan, sdpa_rows: int) -> None:
        """One sequence: its first ``sdpa_rows`` new rows on the SDPA path, the rest tiled."""
        for path, rows in (("sdpa", sdpa_rows), ("tiled", seq.q_len - sdpa_rows)):
            if rows:
                self.sequences[path] += 1
                self.tokens[path] += rows
                self.context[path] += seq.ctx

    @property
    def path(self) -> str:
        """``"sdpa"`` or ``"tiled"`` when every sequence with new tokens took that path,
        ``"mixed"`` when both were taken, ``"none"`` when no sequence had new tokens."""
        used = [p for p, n in self.sequences.items() if n]
        return used[0] if len(used) == 1 else "mixed" if used else "none"


def attend(inp: PrefixInputs, seqs: Iterable[SeqSpan], budget: int, out: torch.Tensor,
           force: Optional[str] = None, causal: bool = True,
           stats: Optional[PrefixStats] = None) -> None:
    """Attend every sequence's query rows into ``out`` under ``budget`` bytes (what was done
    recorded in ``stats`` when given)."""
    query = inp.query
    heads, kv, d = query.shape[1], inp.kv_heads, inp.head_size
    device = query.device
    work = work_dtype(query.dtype, device)
    block = inp.spec.block_size if inp.spec is not None else 16
    alibi = inp.slopes is not None
    if alibi:
        # ALiBi's bias must meet the exact product before the half-precision rounding (a
        # far key's bias and score can both be in the hundreds): its calls compute in
        # float32 in every compute mode (the GPU compute mode with the GPU's tile sizes).
        work = torch.float32
    til = tiling(heads, kv, d, block, work, budget, window=inp.window,
                 gpu=compute_mode(device) == "native", alibi=alibi)
    runner = TiledRunner(inp, til, budget)
    sdpa = (causal and not alibi and isinstance(inp.q_scale, float) and force != "tiled"
            and (force == "sdpa" or sdpa_path_ok(query.dtype, device)))
    sdpa_end = 0
    if sdpa:
        threads = torch.get_num_threads() if device.type == "cpu" else 1
        sdpa_end = (1 << 62) if force == "sdpa" else sdpa_max_end(
            heads, kv, d, query.element_size(), threads, budget)
    for seq in seqs:
        if seq.q_len == 0:
            continue
        split = min(seq.q_len, max(0, sdpa_end - seq.ctx)) if sdpa else 0
        if split:
            sdpa_rows(inp, seq, split, out, None if force == "sdpa" else sdpa_end)
        if split < seq.q_len:
            _warn_small_budget(til, heads, kv, d, budget, seq.end, inp.spec is not None,
                               inp.window)
            runner.run(seq, out, split)
        if stats is not None:
            stats.record(seq, split)
    reruns = runner.recompute(out)
    if stats is not None:
        stats.fp32_reruns += reruns


def _warn_small_budget(til: Tiling, heads: int, kv: int, d: int, budget: int,
                       end: int, gathered: bool, window: Optional[int] = None) -> None:
    """One WARNING per setting when a sequence's minimum working set (its last score row and
    one key tile's staged K/V in three quarters of the budget, ``minimum_working_set``)
    passes the budget; the kernels then run over it."""
    key = (budget, heads, kv, d, til.work, til.row_elem, window)
    if key in _warned:
        return
    least = minimum_working_set(til, kv, d, end, gathered, window)
    if least > budget:
        _warned.add(key)
        size = til.tile_of(end - 1)[1]
        log.warning("prefix/dense attention: budget %d MiB is below the minimum working set "
                    "(%.1f MiB: %d query rows against %d keys, one key tile's staged K/V); "
                    "running over it", budget >> 20, least / 2**20, size,
                    window_keys(til, size, end, window))
