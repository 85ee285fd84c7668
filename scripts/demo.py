#!/usr/bin/env python3
"""The main job: in an environment with a real vLLM and the shim installed, show the shim
activating by itself, patching vLLM's PagedAttention, and computing decode and prefix attention
on paged KV caches through the patched methods (checked against a dense reference).

Run by ``nox -s demo`` (which builds that environment); runs as is in any such environment.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "real"))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    import vllm_bi100_patch as shim
    from vllm_bi100_patch import versions

    info = versions.installed_vllm_version()
    family = versions.family_for(info)
    print(f"vLLM {info.raw}, signature family {family.name if family else 'unsupported'}")
    pa = importlib.import_module("vllm.attention.ops.paged_attn")   # the shim patches here
    st = shim.status()
    print(f"activated by {st['activated_by']}; patched {st['patched']}; "
          f"import guard {st['import_guard']}")
    if family is None or sorted(st["patched"]) != ["forward_decode", "forward_prefix"]:
        print("the shim did not patch this vLLM (see the warning above)")
        return 1
    from probe import compute

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
    from vllm_bi100_patch import import_guard

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
    ok = (result["decode_err"] < 1e-4 and result["prefix_err"] < 1e-4
          and import_guard.is_substitute(pp) and blocked)
    print("DEMO OK" if ok else "DEMO FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
