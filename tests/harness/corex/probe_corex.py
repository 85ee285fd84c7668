"""Runs in a fresh interpreter of the CoreX 3.2.3 stand-in venv (``nox -s real-corex-3.2.3``).

``python probe_corex.py MODE`` prints one JSON line prefixed with ``@@REPORT@@``.  vLLM is
driven exactly as the vendor's XFormers backend drives it: ``head_mapping`` built as that
backend builds it and passed as ``forward_decode``'s 8th argument, ``write_to_paged_cache``
through the vendor ops, ``forward_decode`` with 12 and ``forward_prefix`` with 15 positional
arguments.  References are float64 attention over the dense K/V the probe generated itself
(never read back from the cache).  Modes:

  facts   what the stand-in is (version, signatures, Triton, ixformer) and the shim's status
  stock   VLLM_BI100_PATCH=0: the vendor build's own behaviour (hazards included)
  decode  the decode grid through the patched forward_decode
  prefix  chunked prefill (context 0, then chunks) and a prefix-cache hit through the
          patched forward_prefix
  blocks  KV blocks swapped out to host memory and back through PagedAttention.swap_blocks
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import traceback
from typing import Any, Dict, List, Sequence

import torch

# Run in a fresh interpreter of the stand-in venv, outside pytest: tests/ for the helpers package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from helpers.probes import error_of  # noqa: E402
from helpers.probes import report as emit  # noqa: E402
from helpers.reference import attend  # noqa: E402

BLOCK = 16

#: Elementwise tolerance |out - ref| <= atol + rtol * |ref| per output dtype: two half-ulps of
#: the output's rounding (fp16 2^-11, bf16 2^-8 relative) plus a small absolute floor; the
#: measured worst cases are about half of it (see the closing notes of the CoreX issue).
TOL = {torch.float16: (1e-4, 1e-3), torch.bfloat16: (1e-3, 8e-3)}
#: Prefix on CPU runs SDPA, which rounds the bf16 probabilities before P.V: one more bf16
#: rounding (measured worst 2.0 of the decode tolerance), so twice the decode tolerance.
PREFIX_TOL = {torch.float16: (1e-4, 1e-3), torch.bfloat16: (2e-3, 1.6e-2)}


def worst(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, table=None) -> float:
    """max |out - ref| / (atol + rtol |ref|): <= 1 passes."""
    atol, rtol = (table or TOL)[dtype]
    return float(((out.double() - ref).abs() / (atol + rtol * ref.abs())).max())


class VendorLayer:
    """One attention layer driven like CoreX 3.2.3's XFormers backend."""

    def __init__(self, num_heads: int, kv_heads: int, head_size: int, dtype: torch.dtype,
                 num_blocks: int, seed: int = 0) -> None:
        from vllm.attention.ops.paged_attn import PagedAttention

        self.pa = PagedAttention
        self.num_heads, self.kv_heads, self.head_size, self.dtype = (num_heads, kv_heads,
                                                                     head_size, dtype)
        self.scale = head_size ** -0.5
        self.head_mapping = torch.repeat_interleave(  # as the vendor backend builds it
            torch.arange(kv_heads, dtype=torch.int32), num_heads // kv_heads)
        shape = PagedAttention.get_kv_cache_shape(num_blocks, BLOCK, kv_heads, head_size)
        self.kv_cache = torch.zeros(shape, dtype=dtype)
        self.key_cache, self.value_cache = PagedAttention.split_kv_cache(self.kv_cache, kv_heads,
                                                                         head_size)
        self.gen = torch.Generator().manual_seed(seed)
        self.next_block = 0
        self.num_blocks = num_blocks

    def blocks_for(self, tokens: int) -> List[int]:
        n = math.ceil(tokens / BLOCK)
        if self.next_block + n > self.num_blocks:
            raise RuntimeError("probe: cache too small")
        # Interleave: physical blocks of one sequence are not contiguous.
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids[::2] + ids[1::2]

    def write(self, k: torch.Tensor, v: torch.Tensor, blocks: Sequence[int], start: int) -> None:
        slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK
                              for p in range(start, start + k.shape[0])], dtype=torch.int64)
        self.pa.write_to_paged_cache(k, v, self.key_cache, self.value_cache, slots, "auto",
                                     1.0, 1.0)

    def sequence(self, length: int, query: torch.Tensor):
        """Random K/V for ``length`` tokens with two planted needles (first and last token)
        that each take ~40% of the attention of ``query``'s group, so a missing or misplaced
        key at either end changes the output."""
        k = torch.randn(length, self.kv_heads, self.head_size, generator=self.gen)
        v = torch.randn(length, self.kv_heads, self.head_size, generator=self.gen)
        group = self.num_heads // self.kv_heads
        target = math.log(max(length, 2)) + 1.0
        for j in range(self.kv_heads):
            base = query[j * group:(j + 1) * group].double().mean(0)
            needle = (target / (self.scale * float(base @ base))) * base
            for pos in {0, length - 1}:
                k[pos, j] = needle.float()
        return k.to(self.dtype), v.to(self.dtype)

    def queries(self, n: int) -> torch.Tensor:
        group = self.num_heads // self.kv_heads
        base = torch.randn(n, self.kv_heads, 1, self.head_size, generator=self.gen)
        noise = torch.randn(n, self.kv_heads, group, self.head_size, generator=self.gen)
        return (base + 0.3 * noise).reshape(n, self.num_heads, self.head_size).to(self.dtype)

    def decode(self, query, tables, seq_lens, max_seq_len):
        return self.pa.forward_decode(query, self.key_cache, self.value_cache, tables, seq_lens,
                                      max_seq_len, "auto", self.head_mapping, self.scale, None,
                                      1.0, 1.0)

    def prefix(self, query, key, value, tables, query_start_loc, seq_lens, context_lens,
               max_query_len):
        return self.pa.forward_prefix(query, key, value, "auto", self.key_cache,
                                      self.value_cache, tables, query_start_loc, seq_lens,
                                      context_lens, max_query_len, None, None, 1.0, 1.0)


def build_batch(layer: VendorLayer, lengths: Sequence[int]):
    query = layer.queries(len(lengths))
    width = max(math.ceil(n / BLOCK) for n in lengths)
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    refs = []
    for i, n in enumerate(lengths):
        k, v = layer.sequence(n, query[i])
        blocks = layer.blocks_for(n)
        tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        layer.write(k, v, blocks, 0)
        refs.append(attend(query[i:i + 1], k, v, [n - 1], layer.scale)[0])
    return query, tables, torch.tensor(lengths, dtype=torch.int32), torch.stack(refs)


def counters() -> Dict[str, int]:
    from ixformer import functions

    out = {"ixformer_v1": functions.CALLS.get("vllm_single_query_cached_kv_attention", 0)}
    if "vllm_bi100_patch.attention.native.decoder" in sys.modules:
        from vllm_bi100_patch.attention.native import decoder as dispatch

        out.update(dispatch.route_counts())
    return out


def run_decode_case(heads: int, kv_heads: int, head_size: int, dtype: torch.dtype,
                    lengths: Sequence[int]) -> Dict[str, Any]:
    layer = VendorLayer(heads, kv_heads, head_size, dtype,
                        sum(math.ceil(n / BLOCK) for n in lengths) + 2)
    query, tables, seq_lens, ref = build_batch(layer, lengths)
    before = counters()
    case: Dict[str, Any] = {"heads": heads, "kv_heads": kv_heads, "head_size": head_size,
                            "dtype": str(dtype).replace("torch.", ""), "lengths": list(lengths)}
    try:
        out = layer.decode(query, tables, seq_lens, max(lengths))
    except BaseException as exc:  # noqa: B902
        case["error"] = f"{type(exc).__name__}: {exc}"
        return case
    after = counters()
    case["routes"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    diff = (out.double() - ref).abs()
    case["max_abs_err"] = float(diff.max())
    case["worst"] = worst(out, ref, dtype)
    case["ref_absmax"] = float(ref.abs().max())
    # The error a dropped last key would cause (what the test must be able to see).
    case["needle_weight_effect"] = float((ref - dense_drop_last(layer, query, tables,
                                                                 lengths)).abs().max())
    return case


def dense_drop_last(layer, query, tables, lengths):
    """The reference without each sequence's last token (read back from the cache only for
    this sensitivity figure)."""
    outs = []
    x = layer.key_cache.shape[-1]
    for i, n in enumerate(lengths):
        if n < 2:
            outs.append(torch.zeros(layer.num_heads, layer.head_size, dtype=torch.float64))
            continue
        pos = torch.arange(n - 1)
        blk = tables[i].long()[pos // BLOCK]
        off = pos % BLOCK
        k = layer.key_cache[blk, :, :, off, :].reshape(n - 1, layer.kv_heads, -1)
        v = layer.value_cache[blk, :, :, off]
        assert k.shape[-1] == layer.head_size and x > 0
        outs.append(attend(query[i:i + 1], k, v, [n - 1], layer.scale)[0])
    return torch.stack(outs)


DECODE_LENGTHS = ([100], [4000], [20000], [32767], [32768], [32769], [40000],
                  [100, 32768], [5, 32769], [32768, 40000, 1])
BOUNDARY_LENGTHS = ([32768], [32769], [100, 33000])


def mode_decode() -> None:
    import vllm_bi100_patch

    cases = []
    for lengths in DECODE_LENGTHS:  # the whole length grid on one shape
        cases.append(run_decode_case(8, 2, 128, torch.float16, lengths))
    for heads, kv in ((2, 2), (8, 2), (8, 1)):  # GQA 1 / 4 / 8
        for head_size in (128, 256):
            for dtype in (torch.float16, torch.bfloat16):
                for lengths in BOUNDARY_LENGTHS:
                    cases.append(run_decode_case(heads, kv, head_size, dtype, lengths))
    emit(cases=cases, status=vllm_bi100_patch.status())


def mode_prefix() -> None:
    import vllm_bi100_patch

    results = []
    for head_size, dtype in ((128, torch.float16), (256, torch.bfloat16)):
        layer = VendorLayer(8, 2, head_size, dtype, num_blocks=64, seed=1)
        total = 300
        k_all = torch.randn(total, 2, head_size, generator=layer.gen).to(dtype)
        v_all = torch.randn(total, 2, head_size, generator=layer.gen).to(dtype)
        q_all = layer.queries(total)
        ref = attend(q_all, k_all, v_all, range(total), layer.scale)
        blocks = layer.blocks_for(total)
        tables = torch.tensor([blocks], dtype=torch.int32)
        # Chunked prefill: context 0, then chunks; each chunk's K/V is written first, as the
        # backend does, then attends over the cached context plus itself.
        start = 0
        for chunk in (64, 100, 36, 100):
            end = start + chunk
            layer.write(k_all[start:end], v_all[start:end], blocks, start)
            out = layer.prefix(q_all[start:end], k_all[start:end], v_all[start:end], tables,
                               torch.tensor([0, chunk], dtype=torch.int32),
                               torch.tensor([end], dtype=torch.int32),
                               torch.tensor([start], dtype=torch.int32), chunk)
            results.append({"kind": "chunk", "head_size": head_size,
                            "dtype": str(dtype).replace("torch.", ""), "context": start,
                            "query": chunk, "worst": worst(out, ref[start:end], dtype, PREFIX_TOL),
                            "max_abs_err": float((out.double() - ref[start:end]).abs().max())})
            start = end
        # A prefix-cache hit: a second request shares the first 256 tokens (16 whole blocks)
        # and brings 44 new ones; its table points at the same physical blocks.
        hit = 256
        new_k = torch.randn(44, 2, head_size, generator=layer.gen).to(dtype)
        new_v = torch.randn(44, 2, head_size, generator=layer.gen).to(dtype)
        new_q = layer.queries(44)
        own = layer.blocks_for(44)
        table2 = torch.tensor([blocks[:hit // BLOCK] + own], dtype=torch.int32)
        layer.write(new_k, new_v, table2[0].tolist(), hit)
        out = layer.prefix(new_q, new_k, new_v, table2, torch.tensor([0, 44], dtype=torch.int32),
                           torch.tensor([hit + 44], dtype=torch.int32),
                           torch.tensor([hit], dtype=torch.int32), 44)
        ref2 = attend(new_q, torch.cat([k_all[:hit], new_k]), torch.cat([v_all[:hit], new_v]),
                      range(hit, hit + 44), layer.scale)
        results.append({"kind": "prefix-hit", "head_size": head_size,
                        "dtype": str(dtype).replace("torch.", ""), "context": hit, "query": 44,
                        "worst": worst(out, ref2, dtype, PREFIX_TOL),
                        "max_abs_err": float((out.double() - ref2).abs().max())})
    emit(results=results, status=vllm_bi100_patch.status())


def mode_blocks() -> None:
    """Preemption by swapping: blocks out to host memory and back in, bit-identical."""
    import vllm_bi100_patch

    layer = VendorLayer(8, 2, 128, torch.float16, num_blocks=12, seed=3)
    layer.kv_cache.copy_(torch.randn(layer.kv_cache.shape, generator=layer.gen).half())
    original = layer.kv_cache.clone()
    host = torch.zeros((2, 8, layer.kv_cache.shape[2]), dtype=torch.float16)
    out_map = torch.tensor([[3, 0], [7, 5], [11, 2]], dtype=torch.int64)
    layer.pa.swap_blocks(layer.kv_cache, host, out_map)
    layer.kv_cache.zero_()
    in_map = torch.tensor([[0, 1], [5, 4], [2, 9]], dtype=torch.int64)
    layer.pa.swap_blocks(host, layer.kv_cache, in_map)
    same = all(torch.equal(layer.kv_cache[:, d].view(torch.int16),
                           original[:, s].view(torch.int16))
               for (s, _), (_, d) in zip(out_map.tolist(), in_map.tolist()))
    emit(bit_identical=same, status=vllm_bi100_patch.status())


def mode_stock() -> None:
    from vllm import _custom_ops as ops

    report: Dict[str, Any] = {}
    layer = VendorLayer(8, 2, 128, torch.float16, num_blocks=2 * 2051 + 8)
    q, tables, seq_lens, ref = build_batch(layer, [32768])
    out = layer.decode(q, tables, seq_lens, 32768)
    report["decode_32768_worst"] = worst(out, ref, torch.float16)
    q2, tables2, seq_lens2, _ = build_batch(layer, [32769])
    report["decode_32769"] = error_of(lambda: layer.decode(q2, tables2, seq_lens2, 32769))
    report["forward_prefix"] = error_of(lambda: layer.prefix(
        q[:, :, :], q[:, :2, :], q[:, :2, :], tables, torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), 1))
    report["import_prefix_prefill"] = error_of(
        lambda: __import__("vllm.attention.ops.prefix_prefill"))
    report["swap_blocks"] = error_of(lambda: layer.pa.swap_blocks(
        layer.kv_cache, torch.zeros_like(layer.kv_cache), torch.tensor([[0, 1]])))
    report["v2"] = error_of(lambda: ops.paged_attention_v2(*([None] * 17)))
    report["counters"] = counters()
    emit(**report)


def mode_facts() -> None:
    import importlib.metadata as md

    import vllm_bi100_patch
    from vllm import _custom_ops as ops
    from vllm.attention.ops import paged_attn
    from vllm.triton_utils import HAS_TRITON

    emit(version=md.version("vllm"), has_triton=HAS_TRITON,
         v1_params=list(inspect.signature(ops.paged_attention_v1).parameters),
         v2_params=list(inspect.signature(ops.paged_attention_v2).parameters),
         binds_context_attention_fwd="context_attention_fwd" in vars(paged_attn),
         ixformer=__import__("ixformer").__version__, status=vllm_bi100_patch.status())


if __name__ == "__main__":
    try:
        {"facts": mode_facts, "stock": mode_stock, "decode": mode_decode,
         "prefix": mode_prefix, "blocks": mode_blocks}[sys.argv[1]]()
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
