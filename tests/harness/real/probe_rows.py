"""Which of the serving-path rows (``kv_write``, ``dense_prefill``) the shim applies to the real
vLLM of this venv.  Run in a fresh interpreter (``test_serving_rows.py``); stdlib + torch.

The XFormers backend imports ``xformers``, which the CPU venvs lack: the test puts the CPU
stand-in ``tests/fakes/fake_xformers`` on ``PYTHONPATH`` (the CoreX stand-in has it installed).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/

from helpers.probes import report  # noqa: E402


def main() -> None:
    import torch

    import vllm_bi100_patch as shim
    from vllm_bi100_patch.patching import registry

    from vllm.attention.backends import xformers as backend  # noqa: E402
    from vllm.attention.ops.paged_attn import PagedAttention

    impl_cls = backend.XFormersImpl
    st = shim.status()
    out = {"xops": backend.xops.__name__,
           "dense_ours": registry.is_ours(vars(impl_cls)["_run_memory_efficient_xformers_forward"]),
           "write_ours": registry.is_ours(vars(PagedAttention)["write_to_paged_cache"]),
           "skipped": st["report"]["skipped"], "patched": st["patched"]}
    # A head-256 prompt batch through the backend as it is here.
    heads, kv, dim, lens = 4, 2, 256, [5, 11]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens), heads * dim, generator=gen)
    k = torch.randn(sum(lens), kv * dim, generator=gen)
    v = torch.randn(sum(lens), kv * dim, generator=gen)
    meta = backend.XFormersMetadata(
        num_prefills=2, num_prefill_tokens=sum(lens), num_decode_tokens=0,
        slot_mapping=torch.full((sum(lens),), -1), seq_lens=lens,
        seq_lens_tensor=torch.tensor(lens), max_query_len=max(lens),
        max_prefill_seq_len=max(lens), max_decode_seq_len=0,
        query_start_loc=torch.tensor([0, 5, 16]), seq_start_loc=torch.tensor([0, 5, 16]),
        context_lens_tensor=torch.zeros(2, dtype=torch.int32),
        block_tables=torch.empty(2, 0, dtype=torch.int32), use_cuda_graph=False)
    impl = impl_cls(heads, dim, dim ** -0.5, kv, None, None, "auto")
    res = impl.forward(q, k, v, torch.empty(0), meta).view(-1, heads, dim)
    ref = torch.empty_like(res)
    start = 0
    for n in lens:
        qs = q[start:start + n].view(n, heads, dim).transpose(0, 1)
        ks = k[start:start + n].view(n, kv, dim).repeat_interleave(heads // kv, 1).transpose(0, 1)
        vs = v[start:start + n].view(n, kv, dim).repeat_interleave(heads // kv, 1).transpose(0, 1)
        ref[start:start + n] = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True).transpose(0, 1)
        start += n
    out["prompt_max_err"] = float((res - ref).abs().max())
    out["counts"] = shim.status()["counts"]
    report(**out)


if __name__ == "__main__":
    main()
