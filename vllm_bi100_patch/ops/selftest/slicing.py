# mypy: disable-error-code="call-arg,arg-type,misc"
# (the checks unpack argument lists built by the reference helpers: *args then more positionals)
"""One prompt, computed under different slicings, row by row (issue 20: same prompt, same
answer).  Needs torch only (the device checks, ``checks.py``, run it on the operator's card).

``prompt`` draws a sequence's queries, keys and values; ``prefix_rows`` computes every row
through ``paged_prefix`` as vLLM would slice it (``steps``: ``(first, last)`` position ranges
in order; before each step the cache holds the earlier positions, written the way vLLM's
``reshape_and_cache`` writes them, and the block slots past them hold NaN), optionally with
batch mates in the same calls; ``dense_rows`` computes the whole prompt in one call of the
dense kernel.  Rows are compared with ``same_rows`` (bit for bit, as integers).
"""

from __future__ import annotations

import math
import random
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ...attention.kernels import kv_write, paged_prefix
from ...attention.kernels.prefill import dense

Steps = Sequence[Tuple[int, int]]


def prompt(length: int, heads: int, kv_heads: int, head_size: int, dtype: torch.dtype,
           seed: int, amp: float = 1.0) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"q": (torch.randn(length, heads, head_size, generator=g) * amp).to(dtype),
            "k": (torch.randn(length, kv_heads, head_size, generator=g) * amp).to(dtype),
            "v": torch.randn(length, kv_heads, head_size, generator=g).to(dtype)}


def chunked(length: int, size: int) -> List[Tuple[int, int]]:
    """Chunked prefill in chunks of ``size`` tokens."""
    return [(a, min(length, a + size)) for a in range(0, length, size)]


def hit(length: int, cached: int, then: Optional[int] = None) -> List[Tuple[int, int]]:
    """A prefix-cache hit of ``cached`` tokens, then the rest (in one step, or the rest of
    the partly filled block first when ``then`` is given)."""
    if then is None:
        return [(cached, length)]
    return [(cached, min(length, then)), (min(length, then), length)]


def _write(kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, kv_cache_dtype: str, k_scale: float, v_scale: float) -> None:
    if kv_cache_dtype != "auto":
        kv_write.write_fp8(k, v, kc, vc, slots, kv_cache_dtype, k_scale, v_scale)
        return
    bs, x = vc.shape[3], kc.shape[4]
    blk, off = slots // bs, slots % bs
    kc[blk, :, :, off, :] = k.reshape(k.shape[0], k.shape[1], -1, x)
    vc[blk, :, :, off] = v


class Batch:
    """A paged cache shared by the prompt and its batch mates (random block tables)."""

    def __init__(self, p: Dict[str, torch.Tensor], block_size: int, kv_cache_dtype: str,
                 mates: int, seed: int, k_scale: float = 0.5, v_scale: float = 2.0) -> None:
        self.p, self.bs, self.kvd = p, block_size, kv_cache_dtype
        self.k_scale, self.v_scale = k_scale, v_scale
        rnd = random.Random(seed)
        length, kv, d = p["k"].shape
        heads = p["q"].shape[1]
        dtype = p["q"].dtype
        self.mates = [(rnd.randint(0, 70), rnd.randint(1, 40)) for _ in range(mates)]
        self.mate_p = [prompt(c + n, heads, kv, d, dtype, seed * 31 + i + 1)
                       for i, (c, n) in enumerate(self.mates)]
        lens = [length] + [c + n for c, n in self.mates]
        blocks = [math.ceil(n / block_size) for n in lens]
        total = sum(blocks) + 1
        fp8 = kv_cache_dtype != "auto"
        store = torch.uint8 if fp8 else dtype
        x = 16 // torch.empty((), dtype=store).element_size()
        self.kc = torch.full((total, kv, d // x, block_size, x), math.nan if not fp8 else 0,
                             dtype=torch.float32).to(store)
        self.vc = torch.full((total, kv, d, block_size), math.nan if not fp8 else 0,
                             dtype=torch.float32).to(store)
        if fp8:  # 0x7f is NaN in e4m3 and e5m2: slots never written must never be read
            self.kc.fill_(0x7F)
            self.vc.fill_(0x7F)
        perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
        width = max(blocks)
        self.tables = torch.zeros((len(lens), width), dtype=torch.int32)
        at = 0
        for i, b in enumerate(blocks):
            self.tables[i, :b] = perm[at:at + b].to(torch.int32)
            at += b
        self.order = list(range(len(lens)))
        rnd.shuffle(self.order)
        for i, (c, _) in enumerate(self.mates):  # mates' contexts are cached already
            self._store(i + 1, self.mate_p[i], 0, c)

    def _store(self, row: int, p: Dict[str, torch.Tensor], a: int, b: int) -> None:
        if b <= a:
            return
        pos = torch.arange(a, b)
        slots = self.tables[row].long()[pos // self.bs] * self.bs + pos % self.bs
        _write(self.kc, self.vc, slots, p["k"][a:b], p["v"][a:b], self.kvd, self.k_scale,
               self.v_scale)

    def step(self, a: int, b: int, device: torch.device, **kw: object) -> torch.Tensor:
        """The prompt's rows ``[a, b)`` computed with the cache holding ``[0, a)``, the
        batch mates in the same call; then ``[a, b)`` is written to the cache."""
        seqs = []
        for i in self.order:
            if i == 0:
                seqs.append((self.p, a, b, 0))
            else:
                c, n = self.mates[i - 1]
                seqs.append((self.mate_p[i - 1], c, c + n, i))
        q = torch.cat([p["q"][x:y] for p, x, y, _ in seqs])
        k = torch.cat([p["k"][x:y] for p, x, y, _ in seqs])
        v = torch.cat([p["v"][x:y] for p, x, y, _ in seqs])
        starts = [0]
        for _, x, y, _ in seqs:
            starts.append(starts[-1] + y - x)
        tables = torch.stack([self.tables[i] for *_, i in seqs])
        qsl = torch.tensor(starts, dtype=torch.int32)
        sl = torch.tensor([y for _, _, y, _ in seqs], dtype=torch.int32)
        cl = torch.tensor([x for _, x, _, _ in seqs], dtype=torch.int32)
        extra = {} if self.kvd == "auto" else {"kv_cache_dtype": self.kvd,
                                                "k_scale": self.k_scale,
                                                "v_scale": self.v_scale}
        args = [t.to(device) for t in (q, k, v, self.kc, self.vc, tables, qsl, sl, cl)]
        out = paged_prefix(*args, **extra, **kw).cpu()  # type: ignore[arg-type]
        at = self.order.index(0)
        self._store(0, self.p, a, b)
        return out[starts[at]:starts[at + 1]]


def prefix_rows(p: Dict[str, torch.Tensor], steps: Steps, *, block_size: int = 16,
                kv_cache_dtype: str = "auto", mates: int = 0, seed: int = 0,
                device: str = "cpu", **kw: object) -> torch.Tensor:
    """Rows ``[steps[0][0], steps[-1][1])`` of the prompt, computed step by step."""
    batch = Batch(p, block_size, kv_cache_dtype, mates, seed)
    batch._store(0, p, 0, steps[0][0])  # a prefix-cache hit: those blocks are cached
    rows = [batch.step(a, b, torch.device(device), **kw) for a, b in steps]
    return torch.cat(rows)


def dense_rows(p: Dict[str, torch.Tensor], *, device: str = "cpu",
               **kw: object) -> torch.Tensor:
    """Every row of the prompt from one call of the dense kernel (head_size ** -0.5)."""
    q, k, v = (p[n].to(device) for n in "qkv")
    scale = q.shape[2] ** -0.5
    return dense.varlen_attention(q, k, v, [q.shape[0]], scale, **kw).cpu()  # type: ignore


def same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, compared as integers (so the sign of zero counts: ``torch.equal`` holds
    -0.0 == +0.0), no NaN anywhere."""
    if a.shape != b.shape or a.dtype != b.dtype or not bool(torch.isfinite(a).all()):
        return False
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))
