#!/usr/bin/env python3
"""The cost of ``VLLM_BI100_PROMPT_ATTENTION=shim``: the shim's prompt kernel against the
backend's own on the same prompts.

    python scripts/prompt_attention_cost.py [--quick] [--repeats N]

Two tables:

1. **CPU time** (medians of interleaved repeats, measured side by side in this run): the
   shim's ``kernels.prefill.dense.varlen_attention`` (this CPU's formulation: float32) against what
   the XFormers backend calls without the opt-in on the stock wheels in the tests, the CPU
   stand-in of xformers (``tests/fakes/fake_xformers``: a float32 reference, vLLM's 5-D
   grouped-query layout and ``BlockDiagonalCausalMask``), and torch's fused
   ``scaled_dot_product_attention`` (causal, one prompt at a time) as the nearest thing to a
   fused flash kernel a CPU has.  Neither is xformers' CUDA kernel nor ixformer's FwOp: the
   CPU ratios say what the shim costs against a float32 reference and against a fused CPU
   kernel, not what it costs on the card.
2. **Account in the GPU compute mode** (``tools/account.py``, device-independent): launches,
   bytes and FLOPs of the shim's kernel on the GPU's path (the tiled one, which every GPU
   takes; half-precision matrix products, float32 softmax),
   against the minimum any fused kernel needs (one launch, Q/K/V read and O written once,
   ``4 * H * D`` FLOPs per causal query-key pair), each turned into a **modelled** BI-V100
   time (``tools.account.predict``; a model, not a measurement).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "fakes", "fake_xformers")]

import torch  # noqa: E402
from xformers.ops import fmha  # noqa: E402  (the tests' CPU stand-in)

from tools.account import DEVICES, Account, predict  # noqa: E402
from vllm_bi100_patch.attention.kernels.forced import forced  # noqa: E402
from vllm_bi100_patch.attention.kernels.prefill import dense  # noqa: E402

try:  # CPU half-precision GEMMs in float32 for a fast account (same counts), where it exists
    from tools.account import HalfGemmsInFloat as _fast_gemms  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - an older tools/account.py
    from contextlib import nullcontext as _fast_gemms

HEADS, KV_HEADS, HEAD = 32, 8, 128
CASES = ((2048,), (1024, 1024, 1024, 1024))
QUICK = ((256,), (128, 128))


def _inputs(lens, dtype):
    g = torch.Generator().manual_seed(0)
    t = sum(lens)
    q = torch.randn(t, HEADS, HEAD, generator=g).to(dtype)
    k = torch.randn(t, KV_HEADS, HEAD, generator=g).to(dtype)
    v = torch.randn(t, KV_HEADS, HEAD, generator=g).to(dtype)
    return q, k, v


def shim(q, k, v, lens):
    return dense.varlen_attention(q, k, v, list(lens), HEAD ** -0.5)


def xformers_standin(q, k, v, lens):
    """What vLLM 0.6.3's ``_run_memory_efficient_xformers_forward`` passes to xformers."""
    group = HEADS // KV_HEADS
    q5 = q.view(q.shape[0], KV_HEADS, group, HEAD)
    k5 = k[:, :, None, :].expand(k.shape[0], KV_HEADS, group, HEAD)
    v5 = v[:, :, None, :].expand(v.shape[0], KV_HEADS, group, HEAD)
    bias = fmha.BlockDiagonalCausalMask.from_seqlens(list(lens))
    return fmha.memory_efficient_attention_forward(q5[None], k5[None], v5[None],
                                                   attn_bias=bias, scale=HEAD ** -0.5)


def sdpa(q, k, v, lens):
    out, start = torch.empty_like(q), 0
    group = HEADS // KV_HEADS
    for n in lens:
        qs = q[start:start + n].transpose(0, 1)[None]
        ks = k[start:start + n].repeat_interleave(group, 1).transpose(0, 1)[None]
        vs = v[start:start + n].repeat_interleave(group, 1).transpose(0, 1)[None]
        res = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                               scale=HEAD ** -0.5)
        out[start:start + n] = res[0].transpose(0, 1)
        start += n
    return out


def _time(fns, args, repeats):
    times = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        fn(*args)
    for _ in range(repeats):
        for name, fn in fns.items():  # interleaved
            t0 = time.perf_counter()
            fn(*args)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def _fused_minimum(lens, dtype):
    """The minimum of a fused causal kernel: bytes of Q, K, V, O; FLOPs of the causal pairs."""
    elem = torch.empty((), dtype=dtype).element_size()
    t = sum(lens)
    nbytes = (2 * t * HEADS * HEAD + 2 * t * KV_HEADS * HEAD) * elem
    pairs = sum(n * (n + 1) // 2 for n in lens)
    return nbytes, 4 * HEADS * HEAD * pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    cases = QUICK if opts.quick else CASES
    dtype = torch.bfloat16
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {HEADS} heads / "
          f"{KV_HEADS} KV heads, head size {HEAD}, bf16, causal; medians of {opts.repeats}\n")
    print("| prompts | shim ms | xformers CPU stand-in ms | SDPA ms | shim / stand-in | "
          "shim / SDPA |")
    print("|---|---|---|---|---|---|")
    for lens in cases:
        args = (*_inputs(lens, dtype), lens)
        ms = _time({"shim": shim, "xf": xformers_standin, "sdpa": sdpa}, args, opts.repeats)
        print(f"| {len(lens)}x{lens[0]} | {ms['shim']:.1f} | {ms['xf']:.1f} | {ms['sdpa']:.1f} "
              f"| {ms['shim'] / ms['xf']:.2f}x | {ms['shim'] / ms['sdpa']:.2f}x |")
    bi = DEVICES["bi-v100"]
    print("\nGPU compute mode (account; modelled BI-V100 times are a model, not a "
          "measurement)\n")
    print("| prompts | shim launches | shim MB | shim GFLOP | fused minimum MB | fused GFLOP | "
          "shim modelled ms | fused modelled ms | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    with forced(compute="native", path="tiled"):  # the GPU's computation
        for lens in cases:
            q, k, v = _inputs(lens, dtype)
            with _fast_gemms(), Account() as acc:
                shim(q, k, v, lens)
            nbytes, flops = _fused_minimum(lens, dtype)
            fused_ms = (max(nbytes / bi.bandwidth, flops / bi.flops) + bi.launch_s) * 1e3
            shim_ms = predict(acc, bi) * 1e3
            print(f"| {len(lens)}x{lens[0]} | {acc.launches} | {acc.bytes / 1e6:.1f} | "
                  f"{acc.flops / 1e9:.2f} | {nbytes / 1e6:.1f} | {flops / 1e9:.2f} | "
                  f"{shim_ms:.3f} | {fused_ms:.3f} | {shim_ms / fused_ms:.1f}x |")


if __name__ == "__main__":
    main()
