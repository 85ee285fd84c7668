#!/usr/bin/env python3
"""The main job: in an environment with a real vLLM and the shim installed, show the shim
activating by itself, patching vLLM's PagedAttention, and computing decode and prefix attention
on paged KV caches through the patched methods (checked against a dense reference).

Run by ``nox -s demo`` (which builds that environment); runs as is in any such environment.
Self-contained: the paged caches and the dense reference (float64, one sequence at a time,
explicit causal positions) are written below, independently of the shim's kernels.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any, Dict, List


# --------------------------------------------------------------------------------------------
# vLLM's paged KV cache: key [blocks, kv_heads, head_size // x, block_size, x] with
# x = 16 // element size, value [blocks, kv_heads, head_size, block_size]; a sequence's token
# ``pos`` lives in block ``block_table[pos // block_size]`` at offset ``pos % block_size``.

def empty_caches(num_blocks: int, kv_heads: int, head_size: int, block_size: int, dtype: Any):
    import torch

    x = 16 // torch.tensor([], dtype=dtype).element_size()
    return (torch.zeros(num_blocks, kv_heads, head_size // x, block_size, x, dtype=dtype),
            torch.zeros(num_blocks, kv_heads, head_size, block_size, dtype=dtype))


def write_tokens(key_cache, value_cache, block_row, k, v) -> None:
    """Write one sequence's tokens 0 .. len(k)-1 (k, v: [n, kv_heads, head_size])."""
    block_size, x = value_cache.shape[3], key_cache.shape[4]
    for pos in range(k.shape[0]):
        blk, off = int(block_row[pos // block_size]), pos % block_size
        key_cache[blk, :, :, off, :] = k[pos].reshape(k.shape[1], -1, x)
        value_cache[blk, :, :, off] = v[pos]


def attend(q, k, v, scale: float, first_pos: int):
    """Causal attention of q [m, heads, d] (query i at position first_pos + i) over k, v
    [n, kv_heads, d] (key j at position j), in float64."""
    import torch

    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.double(), k) * scale
    q_pos = torch.arange(q.shape[0]) + first_pos
    mask = torch.arange(k.shape[0])[None, :] > q_pos[:, None]
    scores = scores.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(scores, dim=-1), v)


def compute(pa: Any, family: Any) -> Dict[str, float]:
    """Call the patched forward_decode and forward_prefix on paged caches; return their max
    abs errors against the dense reference."""
    import torch

    heads, kv_heads, d, bs = 4, 2, 64, 16
    scale = d ** -0.5
    g = torch.Generator().manual_seed(0)
    seq_lens = torch.tensor([45, 1, 17], dtype=torch.int32)
    new = torch.tensor([6, 1, 2], dtype=torch.int32)   # the prefix call's new tokens
    ctx = seq_lens - new
    kc, vc = empty_caches(24, kv_heads, d, bs, torch.float32)
    block_tables = torch.randperm(24, generator=g)[:12].reshape(3, 4).to(torch.int32)
    ks = [torch.randn(int(n), kv_heads, d, generator=g) for n in seq_lens]
    vs = [torch.randn(int(n), kv_heads, d, generator=g) for n in seq_lens]
    for i in range(3):
        write_tokens(kc, vc, block_tables[i], ks[i], vs[i])
    one = torch.tensor(1.0) if family.scales == "Tensor" else 1.0

    query = torch.randn(3, heads, d, generator=g)
    values = dict(query=query, key_cache=kc, value_cache=vc, block_tables=block_tables,
                  seq_lens=seq_lens, max_seq_len=int(seq_lens.max()), kv_cache_dtype="auto",
                  num_kv_heads=kv_heads, scale=scale, alibi_slopes=None, kv_scale=one,
                  k_scale=one, v_scale=one)
    out = pa.PagedAttention.forward_decode(
        **{n: values[n] for n in family.decode_params if n in values})
    ref = torch.stack([attend(query[i:i + 1], ks[i], vs[i], scale, int(n) - 1)[0]
                       for i, n in enumerate(seq_lens.tolist())])
    decode_err = float((out.double() - ref).abs().max())

    qsl = torch.zeros(4, dtype=torch.int32)
    qsl[1:] = torch.cumsum(new, 0)
    q2 = torch.randn(int(new.sum()), heads, d, generator=g)
    values = dict(query=q2, key=torch.cat([k[c:] for k, c in zip(ks, ctx.tolist())]),
                  value=torch.cat([v[c:] for v, c in zip(vs, ctx.tolist())]),
                  kv_cache_dtype="auto", key_cache=kc, value_cache=vc,
                  block_tables=block_tables, query_start_loc=qsl, seq_lens_tensor=seq_lens,
                  context_lens=ctx, max_query_len=int(new.max()), alibi_slopes=None,
                  sliding_window=None, k_scale=one, v_scale=one)
    out2 = pa.PagedAttention.forward_prefix(
        **{n: values[n] for n in family.prefix_params if n in values})
    refs: List[Any] = [attend(q2[int(qsl[i]):int(qsl[i + 1])], ks[i], vs[i], scale, c)
                       for i, c in enumerate(ctx.tolist())]
    prefix_err = float((out2.double() - torch.cat(refs)).abs().max())
    return {"decode_err": decode_err, "prefix_err": prefix_err}


#: What the demo exists to show: the two attention methods replaced (the shim patches more
#: where the installed vLLM has it, e.g. the serving rows; the demo does not list those).
ATTENTION = ("forward_decode", "forward_prefix")


def unpatched(pa: Any) -> List[str]:
    """The methods of ``ATTENTION`` whose class attribute is not the shim's wrapper."""
    from vllm_bi100_patch.patching import registry

    return [name for name in ATTENTION
            if not registry.is_ours(vars(pa.PagedAttention).get(name))]


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    import vllm_bi100_patch as shim
    from vllm_bi100_patch.patching import versions

    info = versions.installed_vllm_version()
    family = versions.family_for(info)
    print(f"vLLM {info.raw}, signature family {family.name if family else 'unsupported'}")
    pa = importlib.import_module("vllm.attention.ops.paged_attn")   # the shim patches here
    st = shim.status()
    print(f"activated by {st['activated_by']}; patched {st['patched']}; "
          f"import guard {st['import_guard']}")
    missing = unpatched(pa)
    if family is None or missing:
        print(f"the shim did not patch PagedAttention.{', '.join(missing) or 'forward_*'} in "
              "this vLLM (see the warning above)")
        return 1
    result = compute(pa, family)
    print(f"patched forward_decode vs dense reference: max abs error {result['decode_err']:.2e}")
    print(f"patched forward_prefix vs dense reference: max abs error {result['prefix_err']:.2e}")
    counts = shim.status()["counts"]
    print("counters: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    prefix = shim.status()["import_guard"]["prefix_prefill"]
    print(f"vllm.attention.ops.prefix_prefill after the calls: {prefix} (on a CPU torch vLLM "
          "has no Triton and never imports it, so this line alone proves nothing)")
    # The proof: ask for vLLM's Triton module the way vLLM does. Without the shim this loads
    # the real module (whose kernel hangs a BI-V100); with it, the refusing substitute.
    from vllm_bi100_patch.attention import import_guard

    pp = importlib.import_module("vllm.attention.ops.prefix_prefill")
    try:
        pp.context_attention_fwd()
        outcome = "ran"
    except Exception as exc:  # the substitute refuses; the real kernel wants arguments
        outcome = type(exc).__name__
    blocked = outcome == "TritonPrefixBlocked"
    which = "the shim's substitute" if import_guard.is_substitute(pp) else "the real module"
    print(f"import vllm.attention.ops.prefix_prefill -> {which}; "
          f"context_attention_fwd() -> {outcome}")
    print(f"patched method: {pa.PagedAttention.forward_decode!r}")
    # Both calls went through the shim's wrappers (their counters), right within 1e-4, and
    # the Triton module refused.
    ok = (all(counts.get(name, 0) >= 1 for name in ATTENTION)
          and result["decode_err"] < 1e-4 and result["prefix_err"] < 1e-4
          and import_guard.is_substitute(pp) and blocked)
    print("DEMO OK" if ok else "DEMO FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
