"""The rest of the serving path on the CoreX stand-in: prompt prefill through the real vLLM
0.6.3 ``XFormersImpl.forward``, fp8 KV writes through ``PagedAttention.write_to_paged_cache``.

``python probe_serving.py MODE`` prints ``@@REPORT@@`` JSON lines (``helpers.probes``).  The
backend is the stand-in's (the ``xformers-vendor`` delta: ``xops`` from
``ixformer.contrib.xformers``, ``op=FwOp()``, no GQA expansion); prompts have no block table,
so ``forward`` calls ``_run_memory_efficient_xformers_forward``.  References are float64
attention over the dense Q/K/V the probe generated (``helpers.reference.attend``).  Modes:

  stock     VLLM_BI100_PATCH=0: the vendor kernel at head 256 (causal raises, ALiBi garbage)
  dense     the shim in auto mode: varlen prompt batches, head 256 (fp16, bf16, GQA 4:1 and
            8:1, sliding window, ALiBi) against the reference; head 128 on the vendor kernel
  profile   the profiling run: 8,192 tokens, head 256, empty KV cache, peak memory measured
  fp8       --kv-cache-dtype fp8: tokens written through the vendor ops' write_to_paged_cache
            (slot -1 included), the bytes, then decode and prefix reading them back
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/
# The repository root last (tools.memtrack): the shim itself comes from the venv's wheel.
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

from helpers.probes import error_of  # noqa: E402
from helpers.probes import report as emit  # noqa: E402
from helpers.reference import TOLERANCE, attend, rel_error  # noqa: E402

BLOCK = 16


def counters() -> Dict[str, int]:
    from ixformer.contrib.xformers.ops import fmha

    out = {"fwop": fmha.CALLS.get("contrib.xformers.memory_efficient_attention_forward", 0),
           "fwop_garbage": fmha.CALLS.get("contrib.xformers.garbage", 0)}
    if "vllm_bi100_patch.patching.factories" in sys.modules:
        from vllm_bi100_patch.patching import factories

        counts = factories.call_counts()
        out.update(dense=counts.get("dense_prefill", 0), vendor=counts.get("dense_vendor", 0))
    return out


class Layer:
    """One XFormersImpl with a KV cache, driven as vLLM's model runner drives it."""

    def __init__(self, heads: int, kv_heads: int, head_size: int, dtype: torch.dtype,
                 alibi: bool = False, window: Optional[int] = None, num_blocks: int = 64,
                 empty_cache: bool = False, seed: int = 0) -> None:
        from vllm.attention.backends.xformers import XFormersImpl

        self.gen = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.head_size, self.dtype = heads, kv_heads, head_size, dtype
        self.scale = head_size ** -0.5
        slopes = ([float(s) for s in torch.rand(heads, generator=self.gen) * 0.5]
                  if alibi else None)
        self.impl = XFormersImpl(heads, head_size, self.scale, kv_heads, slopes, window, "auto")
        self.alibi = None if slopes is None else torch.tensor(slopes)
        self.window = window
        from vllm.attention.ops.paged_attn import PagedAttention

        shape = PagedAttention.get_kv_cache_shape(num_blocks, BLOCK, kv_heads, head_size)
        self.kv_cache = torch.empty(0, dtype=dtype) if empty_cache else torch.zeros(shape,
                                                                                    dtype=dtype)

    def inputs(self, lens: Sequence[int]):
        t = sum(lens)
        q = torch.randn(t, self.heads, self.head_size, generator=self.gen).to(self.dtype)
        k = torch.randn(t, self.kv_heads, self.head_size, generator=self.gen).to(self.dtype)
        v = torch.randn(t, self.kv_heads, self.head_size, generator=self.gen).to(self.dtype)
        return q, k, v

    def metadata(self, lens: Sequence[int]):
        from vllm.attention.backends.xformers import XFormersMetadata

        n, t = len(lens), sum(lens)
        starts = torch.zeros(n + 1, dtype=torch.int32)
        starts[1:] = torch.cumsum(torch.tensor(lens), 0)
        slots = (torch.arange(t) if self.kv_cache.numel() else torch.full((t,), -1)).long()
        return XFormersMetadata(
            num_prefills=n, num_prefill_tokens=t, num_decode_tokens=0, slot_mapping=slots,
            seq_lens=list(lens), seq_lens_tensor=torch.tensor(lens, dtype=torch.int32),
            max_query_len=max(lens), max_prefill_seq_len=max(lens), max_decode_seq_len=0,
            query_start_loc=starts, seq_start_loc=starts.clone(),
            context_lens_tensor=torch.zeros(n, dtype=torch.int32),
            block_tables=torch.empty(n, 0, dtype=torch.int32), use_cuda_graph=False)

    def forward(self, q, k, v, lens):
        out = self.impl.forward(q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1),
                                v.reshape(v.shape[0], -1), self.kv_cache, self.metadata(lens))
        return out.view(q.shape)

    def reference(self, q, k, v, lens, rows: Optional[List[int]] = None):
        ref = torch.zeros(q.shape, dtype=torch.float64)
        start = 0
        for n in lens:
            pick = range(n) if rows is None else [r for r in rows if r < n]
            idx = [start + r for r in pick]
            if idx:
                ref[idx] = attend(q[idx], k[start:start + n], v[start:start + n], list(pick),
                                  self.scale, self.alibi, self.window)
            start += n
        return ref


LENS = [1, 37, 130, 64, 5]


def case(heads, kv_heads, head_size, dtype, alibi=False, window=None) -> Dict[str, Any]:
    layer = Layer(heads, kv_heads, head_size, dtype, alibi=alibi, window=window)
    q, k, v = layer.inputs(LENS)
    before = counters()
    res: Dict[str, Any] = {"heads": heads, "kv_heads": kv_heads, "head_size": head_size,
                           "dtype": str(dtype).replace("torch.", ""), "alibi": alibi,
                           "window": window}
    try:
        out = layer.forward(q, k, v, LENS)
    except BaseException as exc:  # noqa: B902
        res["error"] = f"{type(exc).__name__}: {exc}"
        return res
    after = counters()
    res["calls"] = {key: after.get(key, 0) - before.get(key, 0) for key in after}
    ref = layer.reference(q, k, v, LENS)
    res["rel_err"] = rel_error(out, ref)
    if alibi or window:  # what ignoring the window / the slopes would cost (the test sees it)
        layer.alibi, layer.window = None, None
        res["plain_vs_ref"] = rel_error(layer.reference(q, k, v, LENS), ref)
    res["tolerance"] = TOLERANCE[("fp32", dtype)]
    return res


def mode_stock() -> None:
    out = {"causal_256": case(8, 2, 256, torch.float16), "alibi_256":
           case(8, 8, 256, torch.float16, alibi=True), "causal_128": case(8, 2, 128, torch.float16)}
    emit(**out)


def mode_dense() -> None:
    import vllm_bi100_patch

    cases = [case(h, kv, 256, dt, alibi=al, window=w)
             for dt in (torch.float16, torch.bfloat16)
             for h, kv in ((8, 2), (8, 1))
             for al, w in ((False, None), (False, 48), (True, None))]
    cases.append(case(8, 2, 128, torch.bfloat16))
    cases.append(case(8, 8, 128, torch.float16, alibi=True))
    st = vllm_bi100_patch.status()
    emit(patched=st["patched"], skipped=st["report"]["skipped"], cases=cases)


def mode_profile() -> None:
    from tools.memtrack import PeakMemory

    from vllm_bi100_patch.activation import config

    tokens, heads, kv_heads, dim, dtype = 8192, 16, 2, 256, torch.bfloat16
    layer = Layer(heads, kv_heads, dim, dtype, empty_cache=True)
    q, k, v = layer.inputs([tokens])
    before = counters()
    with PeakMemory() as mem:
        out = layer.forward(q, k, v, [tokens])
    after = counters()
    rows = [0, 1, 255, 256, 4095, 4096, 8190, 8191] + sorted(
        torch.randint(0, tokens, (8,), generator=layer.gen).tolist())
    ref = layer.reference(q, k, v, [tokens], rows)
    out_bytes = out.numel() * out.element_size()
    emit(peak_bytes=mem.peak_bytes, output_bytes=out_bytes,
         budget_bytes=config.load().prefix_budget_mb << 20,
         untiled_scores_bytes=heads * tokens * tokens * 4,
         calls={key: after.get(key, 0) - before.get(key, 0) for key in after},
         rel_err=rel_error(out[rows], ref[rows]), tolerance=TOLERANCE[("fp32", dtype)],
         finite=bool(torch.isfinite(out).all()))


def _fp8_bytes(x: torch.Tensor, scale: float) -> torch.Tensor:
    """vLLM's fp8 e4m3 bytes of ``x / scale`` (float32 division, saturated), element-wise."""
    top = torch.finfo(torch.float8_e4m3fn).max
    return (x.float() / torch.tensor(scale, dtype=torch.float32)).clamp(-top, top).to(
        torch.float8_e4m3fn).view(torch.uint8)


def mode_fp8() -> None:
    from vllm.attention.ops.paged_attn import PagedAttention as PA

    heads, kv, dim, dtype, k_scale, v_scale = 8, 2, 128, torch.float16, 0.04, 0.02
    gen = torch.Generator().manual_seed(3)
    lens = [40, 7, 90]
    blocks = sum((n + BLOCK - 1) // BLOCK for n in lens) + 2
    kv_cache = torch.zeros(PA.get_kv_cache_shape(blocks, BLOCK, kv, dim), dtype=torch.uint8)
    kc, vc = PA.split_kv_cache(kv_cache, kv, dim)
    ks = [torch.randn(n, kv, dim, generator=gen).to(dtype) for n in lens]
    vs = [torch.randn(n, kv, dim, generator=gen).to(dtype) for n in lens]
    tables = torch.zeros(len(lens), max((n + BLOCK - 1) // BLOCK for n in lens),
                         dtype=torch.int32)
    nxt, res = 0, {}
    want_k, want_v = kc.clone(), vc.clone()
    for i, n in enumerate(lens):
        nb = (n + BLOCK - 1) // BLOCK
        tables[i, :nb] = torch.arange(nxt, nxt + nb, dtype=torch.int32).flip(0)
        nxt += nb
        pos = torch.arange(n)
        slots = tables[i].long()[pos // BLOCK] * BLOCK + pos % BLOCK
        pad_k = torch.randn(3, kv, dim, generator=gen).to(dtype)  # padding tokens, slot -1
        key, value = torch.cat([ks[i], pad_k]), torch.cat([vs[i], pad_k])
        slots = torch.cat([slots, torch.full((3,), -1)])
        for t in range(n):
            s = int(slots[t])
            want_k[s // BLOCK, :, :, s % BLOCK, :] = _fp8_bytes(ks[i][t], k_scale).view(kv, -1,
                                                                                       16)
            want_v[s // BLOCK, :, :, s % BLOCK] = _fp8_bytes(vs[i][t], v_scale)
        err = error_of(lambda key=key, value=value, slots=slots: PA.write_to_paged_cache(
            key, value, kc, vc, slots, "fp8", k_scale, v_scale))
        res.setdefault("write", err)
    res["bytes_equal"] = bool(torch.equal(kc, want_k) and torch.equal(vc, want_v))
    if res["write"] == "no error":
        scale = dim ** -0.5
        head_mapping = torch.repeat_interleave(torch.arange(kv, dtype=torch.int32), heads // kv)
        q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        out = PA.forward_decode(q, kc, vc, tables, seq_lens, max(lens), "fp8", head_mapping,
                                scale, None, k_scale, v_scale)
        ref = torch.stack([attend(q[i:i + 1], ks[i], vs[i], [n - 1], scale)[0]
                           for i, n in enumerate(lens)])
        res["decode_rel_err"] = rel_error(out, ref)
        new, ctx = 10, lens[2] - 10
        qp = torch.randn(new, heads, dim, generator=gen).to(dtype)
        out = PA.forward_prefix(qp, ks[2][ctx:], vs[2][ctx:], "fp8", kc, vc, tables[2:3],
                                torch.tensor([0, new], dtype=torch.int32),
                                torch.tensor([lens[2]], dtype=torch.int32),
                                torch.tensor([ctx], dtype=torch.int32), new, None, None,
                                k_scale, v_scale)
        res["prefix_rel_err"] = rel_error(out, attend(qp, ks[2], vs[2], range(ctx, lens[2]),
                                                      scale))
        from vllm_bi100_patch.patching import factories

        res["counts"] = factories.call_counts()
    emit(**res)


if __name__ == "__main__":
    {"stock": mode_stock, "dense": mode_dense, "profile": mode_profile,
     "fp8": mode_fp8}[sys.argv[1]]()
