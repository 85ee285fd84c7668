#!/usr/bin/env python3
"""Turn an installed official vLLM 0.6.3.post1 into a stand-in of Iluvatar's CoreX 3.2.3 build.

Stdlib only (the noxfile imports it).  Each delta below is one documented difference between
the vendor build (``vllm 0.6.3+corex.3.2.3``) and the official wheel; ``docs/corex-3.2.3.md``
lists them with their public source, and a unit test checks that the two lists agree.  Every
edit checks that the official text it replaces is there (exactly), so a different wheel fails
loudly instead of producing a stand-in that is silently unfaithful.

    VENV/bin/python tests/harness/corex/standin.py        # apply to that venv (idempotent)

What the stand-in cannot model: the real ixformer kernels (the fake ``ixformer`` computes a
CPU reference on the same cache layout) and the real hang (the fake raises ``BI100Hang``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from typing import Callable, List, NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
#: tests/: the fake xformers tree lives in tests/fakes.
TESTS = os.path.dirname(os.path.dirname(HERE))
OFFICIAL = "0.6.3.post1"
VENDOR = "0.6.3+corex.3.2.3"
SOURCE = "repository wudixzy/competition, commit 5a1c8c79 (vendored CoreX 3.2.3 install)"
MARKER = "_bi100_corex_standin.json"


class StandinError(RuntimeError):
    """The installed wheel does not look like the official one the deltas are written for."""


class Delta(NamedTuple):
    ident: str
    path: str            # relative to site-packages
    what: str
    source: str          # file in SOURCE
    apply: Callable[[str], None]


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def _write(path: str, text: str) -> None:
    """Replace ``path`` by a new file (new inode), never write through it: uv hard-links the
    files it installs to its cache, so an in-place write would edit the cached official wheel
    and every venv installed from it."""
    tmp = f"{path}.standin.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    if os.path.exists(path):
        shutil.copymode(path, tmp)
    os.replace(tmp, path)


def _replace_once(text: str, old: str, new: str, where: str) -> str:
    if text.count(old) != 1:
        raise StandinError(f"{where}: expected exactly one occurrence of {old[:60]!r}, found "
                           f"{text.count(old)}")
    return text.replace(old, new)


def _function_span(text: str, name: str, where: str):
    match = re.search(rf"^def {name}\(", text, flags=re.M)
    if match is None:
        raise StandinError(f"{where}: no top-level def {name}(")
    end = re.compile(r"\n\n\n(?=\S)").search(text, match.end())
    if end is None:
        raise StandinError(f"{where}: cannot find the end of {name}")
    return match.start(), end.start()


def _replace_function(text: str, name: str, fingerprint: str, new: str, where: str) -> str:
    start, end = _function_span(text, name, where)
    if fingerprint not in text[start:end]:
        raise StandinError(f"{where}: {name} does not contain {fingerprint!r}")
    return text[:start] + new.strip("\n") + text[end:]


# --- the deltas ----------------------------------------------------------------------------

def _version_metadata(site: str) -> None:
    old = os.path.join(site, f"vllm-{OFFICIAL}.dist-info")
    new = os.path.join(site, f"vllm-{VENDOR}.dist-info")
    meta = os.path.join(old, "METADATA")
    text = _replace_once(_read(meta), f"\nVersion: {OFFICIAL}\n", f"\nVersion: {VENDOR}\n", meta)
    _write(meta, text)
    record = os.path.join(old, "RECORD")
    _write(record, _read(record).replace(f"vllm-{OFFICIAL}.dist-info/",
                                         f"vllm-{VENDOR}.dist-info/"))
    os.rename(old, new)
    version_py = os.path.join(site, "vllm", "_version.py")
    if os.path.exists(version_py):  # the vendor's vllm.__version__ says 0.6.3
        _write(version_py, "__version__ = version = '0.6.3'\n"
                           "__version_tuple__ = version_tuple = (0, 6, 3)\n")


def _no_triton(site: str) -> None:
    path = os.path.join(site, "vllm", "triton_utils", "importing.py")
    _write(path, _replace_once(_read(path), 'HAS_TRITON = find_spec("triton") is not None',
                               "HAS_TRITON = False", path))


_STOCK_V1_CALL = """                alibi_slopes,
                kv_cache_dtype,
                k_scale,
                v_scale,
                tp_rank,
                blocksparse_local_blocks,
                blocksparse_vert_stride,
                blocksparse_block_size,
                blocksparse_head_sliding_step,
            )
        else:
            # Run PagedAttention V2."""
_VENDOR_V1_CALL = """                alibi_slopes,
            )
        else:
            # Run PagedAttention V2."""
_STOCK_RULE = """        use_v1 = (max_seq_len <= 8192
                  and (max_num_partitions == 1 or num_seqs * num_heads > 512))
"""


def _vendor_forward_decode(site: str) -> None:
    path = os.path.join(site, "vllm", "attention", "ops", "paged_attn.py")
    text = _replace_once(_read(path), _STOCK_RULE, _STOCK_RULE + "        use_v1 = True\n", path)
    text = _replace_once(text, _STOCK_V1_CALL, _VENDOR_V1_CALL, path)
    _write(path, text)


_OPS_IMPORT = "import torch.library\n"
_VENDOR_V1 = '''
def paged_attention_v1(
        output,
        query,
        key_cache,
        value_cache,
        head_mapping,
        scale,
        block_tables,
        context_lens,
        block_size,
        max_context_len,
        alibi_slopes=None,
        kv_cache_dtype=None,
):
    return ixf_F.vllm_single_query_cached_kv_attention(
        output, query, key_cache, value_cache, head_mapping, scale, block_tables,
        context_lens, block_size, max_context_len, alibi_slopes)
'''
_V2_BODY_STOCK = """    torch.ops._C.paged_attention_v2(
        out, exp_sum, max_logits, tmp_out, query, key_cache, value_cache,
        num_kv_heads, scale, block_tables, seq_lens, block_size, max_seq_len,
        alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank,
        blocksparse_local_blocks, blocksparse_vert_stride,
        blocksparse_block_size, blocksparse_head_sliding_step)"""


_CACHE_BODY_STOCK = """    torch.ops._C_cache_ops.reshape_and_cache(key, value, key_cache,
                                             value_cache, slot_mapping,
                                             kv_cache_dtype, k_scale, v_scale)"""
_CACHE_BODY_VENDOR = """    slot_mapping = slot_mapping.to(torch.int32)
    ixf_F.vllm_cache_ops_reshape_and_cache(key, value, key_cache,
                                           value_cache, slot_mapping)"""


def _vendor_ops(site: str) -> None:
    path = os.path.join(site, "vllm", "_custom_ops.py")
    text = _replace_once(_read(path), _OPS_IMPORT,
                         _OPS_IMPORT + "import ixformer.functions as ixf_F\n", path)
    text = _replace_function(text, "paged_attention_v1", "torch.ops._C.paged_attention_v1(",
                             _VENDOR_V1, path)
    text = _replace_once(text, _V2_BODY_STOCK, "    raise NotImplementedError()", path)
    start, end = _function_span(text, "reshape_and_cache", path)
    body = _replace_once(text[start:end], _CACHE_BODY_STOCK, _CACHE_BODY_VENDOR, path)
    text = text[:start] + body + text[end:]
    text = _replace_once(text, "    torch.ops._C_cache_ops.swap_blocks(src, dst, block_mapping)",
                         "    ixf_F.swap_blocks(src, dst, block_mapping)", path)
    text = _replace_once(text, "    torch.ops._C_cache_ops.copy_blocks(key_caches, value_caches, "
                               "block_mapping)",
                         "    ixf_F.copy_blocks(key_caches, value_caches, block_mapping)", path)
    _write(path, text)


_MOE_PROBE_STOCK = """supports_moe_ops = False
with contextlib.suppress(ImportError):
    import vllm._moe_C  # noqa: F401
    supports_moe_ops = True
"""
_MOE_FUSED_VENDOR = """

def invoke_fused_moe_kernel(A, B, C, A_scale, B_scale, topk_weights, topk_ids,
                            sorted_token_ids, expert_ids, num_tokens_post_padded,
                            mul_routed_weight, top_k, config, compute_type, use_fp8_w8a8,
                            use_int8_w8a16) -> None:
    ixf_F.vllm_invoke_fused_moe_kernel(A, B, C, topk_weights, topk_ids, sorted_token_ids,
                                       expert_ids, num_tokens_post_padded,
                                       mul_routed_weight, top_k, config['BLOCK_SIZE_M'])
"""


def _vendor_moe_ops(site: str) -> None:
    path = os.path.join(site, "vllm", "_custom_ops.py")
    text = _replace_once(_read(path), _MOE_PROBE_STOCK, "supports_moe_ops = True\n", path)
    text = _replace_once(text, "    torch.ops._C.moe_align_block_size(",
                         "    ixf_F.vllm_moe_align_block_size(", path)
    text = _replace_once(text, "    torch.ops._moe_C.topk_softmax(",
                         "    ixf_F.vllm_moe_topk_softmax(", path)
    start, end = _function_span(text, "topk_softmax", path)
    text = text[:end] + _MOE_FUSED_VENDOR.rstrip("\n") + text[end:]
    _write(path, text)


def _prefix_prefill_hazard(site: str) -> None:
    path = os.path.join(site, "vllm", "attention", "ops", "prefix_prefill.py")
    text = _read(path)
    if "import triton\n" not in text:
        raise StandinError(f"{path}: not the Triton prefix kernel module")
    _write(path, "raise RuntimeError('CoreX stand-in: importing the Triton prefix_prefill "
                 "kernel module stands for the BI-V100 hang')\n" + text)


_XF_IMPORTS_STOCK = """from xformers import ops as xops
from xformers.ops.fmha.attn_bias import (AttentionBias,
                                         BlockDiagonalCausalMask,
                                         BlockDiagonalMask,
                                         LowerTriangularMaskWithTensorBias)
"""
_XF_IMPORTS_VENDOR = """from ixformer.contrib.xformers import ops as xops
from xformers.ops.fmha.attn_bias import (AttentionBias,
                                         BlockDiagonalMask,)
from ixformer.contrib.xformers.ops.fmha.attn_bias import (BlockDiagonalCausalMask,
                                                          LowerTriangularMaskWithTensorBias)
"""
_XF_GQA_STOCK_HEAD = """        original_query = query
        if self.num_kv_heads != self.num_heads:
"""
_XF_GQA_STOCK_TAIL = """                                          value.shape[-1])
        # Set attention bias if not provided."""
_XF_CALL_STOCK = """        if self.alibi_slopes is None:
            # Add the batch dimension.
            query = query.unsqueeze(0)
            key = key.unsqueeze(0)
            value = value.unsqueeze(0)
            out = xops.memory_efficient_attention_forward(
                query,
                key,
                value,
                attn_bias=attn_bias[0],
                p=0.0,
                scale=self.scale)
"""
_XF_CALL_VENDOR = """        self.attn_op = xops.fmha.flash.FwOp()
        if self.alibi_slopes is None:
            # Add the batch dimension.
            query = query.unsqueeze(0)
            key = key.unsqueeze(0)
            value = value.unsqueeze(0)
            out = xops.memory_efficient_attention_forward(
                query,
                key,
                value,
                attn_bias=attn_bias[0],
                p=0.0,
                scale=self.scale,
                op=self.attn_op)
"""
_XF_HEADS_STOCK = """        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
"""
_XF_HEADS_VENDOR = _XF_HEADS_STOCK + """        self.head_mapping = torch.repeat_interleave(
            torch.arange(self.num_kv_heads, dtype=torch.int32),
            self.num_queries_per_kv)
"""
_XF_DECODE_STOCK = """                self.kv_cache_dtype,
                self.num_kv_heads,
                self.scale,
                self.alibi_slopes,"""


def _vendor_xformers_backend(site: str) -> None:
    path = os.path.join(site, "vllm", "attention", "backends", "xformers.py")
    text = _replace_once(_read(path), _XF_IMPORTS_STOCK, _XF_IMPORTS_VENDOR, path)
    head = text.find(_XF_GQA_STOCK_HEAD)
    tail = text.find(_XF_GQA_STOCK_TAIL, head)
    if head < 0 or tail < 0 or text.count(_XF_GQA_STOCK_HEAD) != 1:
        raise StandinError(f"{path}: the GQA expansion of _run_memory_efficient_xformers_forward "
                           "is not the official one")
    kept = "        original_query = query\n        # Set attention bias if not provided."
    text = text[:head] + kept + text[tail + len(_XF_GQA_STOCK_TAIL):]
    text = _replace_once(text, _XF_CALL_STOCK, _XF_CALL_VENDOR, path)
    text = _replace_once(text, _XF_HEADS_STOCK, _XF_HEADS_VENDOR, path)
    text = _replace_once(text, _XF_DECODE_STOCK, _XF_DECODE_STOCK.replace(
        "self.num_kv_heads", "self.head_mapping"), path)
    _write(path, text)


_LOGITS_STOCK = """            # Get the logits for the next tokens.
            logits = self._get_logits(hidden_states, lm_head, embedding_bias)
"""
_LOGITS_VENDOR = ("            # Get the logits for the next tokens.\n"
                  "            if hidden_states.shape[0] > 0:\n"
                  "                logits = self._get_logits(hidden_states, lm_head, embedding_bias)\n"
                  "            else:\n"
                  "                logits = torch.empty([0, lm_head.weight.shape[0]], "
                  "device=hidden_states.device, dtype=hidden_states.dtype)\n")


def _vendor_logits_processor(site: str) -> None:
    path = os.path.join(site, "vllm", "model_executor", "layers", "logits_processor.py")
    _write(path, _replace_once(_read(path), _LOGITS_STOCK, _LOGITS_VENDOR, path))


_SEQUENCE_GUARD = """        if num_new_tokens == 0:
            return []

        return self.data._cached_all_token_ids[-num_new_tokens:]
"""


def _vendor_sequence(site: str) -> None:
    path = os.path.join(site, "vllm", "sequence.py")
    _write(path, _replace_once(_read(path), _SEQUENCE_GUARD,
                               "        return self.data._cached_all_token_ids[-num_new_tokens:]\n",
                               path))


def _vendor_serving_chat(site: str) -> None:
    sys.path.insert(0, HERE)
    try:
        from vendor_serving_chat import EDITS
    finally:
        sys.path.remove(HERE)
    path = os.path.join(site, "vllm", "entrypoints", "openai", "serving_chat.py")
    text = _read(path)
    for old, new in EDITS:
        text = _replace_once(text, old, new, path)
    _write(path, text)


def _fake_xformers(site: str) -> None:
    dest = os.path.join(site, "xformers")
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(os.path.join(TESTS, "fakes", "fake_xformers", "xformers"),
                    dest, ignore=shutil.ignore_patterns("__pycache__"))


def _fake_ixformer(site: str) -> None:
    dest = os.path.join(site, "ixformer")
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(os.path.join(HERE, "fake_ixformer", "ixformer"), dest,
                    ignore=shutil.ignore_patterns("__pycache__"))


DELTAS: List[Delta] = [
    Delta("version", f"vllm-{OFFICIAL}.dist-info", f"version metadata {VENDOR} "
          "(vllm.__version__ 0.6.3)", "docs/baseline/bi100_inventory_20260713.json", _version_metadata),
    Delta("no-triton", "vllm/triton_utils/importing.py", "HAS_TRITON = False, hard-coded",
          "vllm/triton_utils/importing.py", _no_triton),
    Delta("decode-v1-forced", "vllm/attention/ops/paged_attn.py",
          "forward_decode forces use_v1 = True and calls V1 with 11 positional arguments",
          "vllm/attention/ops/paged_attn.py", _vendor_forward_decode),
    Delta("ops-vendor", "vllm/_custom_ops.py",
          "paged_attention_v1(output, query, key_cache, value_cache, head_mapping, scale, "
          "block_tables, context_lens, block_size, max_context_len, alibi_slopes=None, "
          "kv_cache_dtype=None) -> ixformer; paged_attention_v2 raises NotImplementedError; "
          "reshape_and_cache drops kv_cache_dtype and the scales; swap_blocks calls "
          "ixformer.functions.swap_blocks (absent); copy_blocks calls ixformer",
          "vllm/_custom_ops.py", _vendor_ops),
    Delta("ops-moe-vendor", "vllm/_custom_ops.py",
          "supports_moe_ops = True unconditionally; moe_align_block_size, topk_softmax and "
          "invoke_fused_moe_kernel call ixformer.functions.vllm_moe_align_block_size, "
          "vllm_moe_topk_softmax, vllm_invoke_fused_moe_kernel, which 3.2.3's ixformer lacks",
          "vllm/_custom_ops.py; field notes docs/experiments/E_CAP_01_RUNTIME_20260713.md",
          _vendor_moe_ops),
    Delta("prefix-prefill-hazard", "vllm/attention/ops/prefix_prefill.py",
          "importing the Triton prefix kernel raises (stands for the hang)",
          "field notes docs/experiments/E_CTX_01_PAGED_ATTN_GUARDS_20260714.md", _prefix_prefill_hazard),
    Delta("fake-ixformer", "ixformer/", "fake ixformer 0.4.0+corex.3.2.3: CPU reference V1 with "
          "the 32,768 hazard, reshape_and_cache, vllm_swap_blocks(dict), copy_blocks; no V2, no "
          "swap_blocks", "vllm/_custom_ops.py (what it calls)", _fake_ixformer),
    Delta("fake-xformers", "xformers/", "xformers 0.0.27.post2 as a CPU reference "
          "(memory_efficient_attention_forward, the attn_bias masks): the vendor stack has "
          "xformers installed", "vllm/attention/backends/xformers.py (what it imports)",
          _fake_xformers),
    Delta("xformers-vendor", "vllm/attention/backends/xformers.py",
          "the XFormers backend imports xops and the causal masks from ixformer.contrib.xformers, "
          "drops the GQA expansion, passes op=xops.fmha.flash.FwOp() for prompts, builds "
          "head_mapping and passes it to forward_decode; the fake ixformer's FwOp raises for a "
          "causal bias above head size 128 and returns zeros for any other bias there",
          "vllm/attention/backends/xformers.py", _vendor_xformers_backend),
    Delta("logits-vendor", "vllm/model_executor/layers/logits_processor.py",
          "LogitsProcessor.forward builds an empty [0, vocab] logits tensor when no token is "
          "selected for sampling instead of gathering (ranks > 0 of a tensor-parallel group "
          "then run the logits processors over seq_groups=None)",
          "vllm/model_executor/layers/logits_processor.py", _vendor_logits_processor),
    Delta("sequence-vendor", "vllm/sequence.py",
          "Sequence.get_output_token_ids_to_return without the num_new_tokens == 0 case "
          "(vLLM 0.6.2's method): a step without a new token returns every token id",
          "vllm/sequence.py", _vendor_sequence),
    Delta("serving-chat-vendor", "vllm/entrypoints/openai/serving_chat.py",
          "OpenAIServingChat with vLLM 0.6.2's streaming usage code (usage null on every chunk, "
          "per-delta continuous counts, the final usage counting the last choice only), no "
          "skip of empty chunked-prefill outputs, a beam-search assert, logger.error",
          "vllm/entrypoints/openai/serving_chat.py", _vendor_serving_chat),
]


def site_packages(python: str) -> str:
    out = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip()


def apply(python: str) -> List[str]:
    """Apply every delta to the venv of ``python`` (once); returns the delta ids applied."""
    site = site_packages(python)
    marker = os.path.join(site, "vllm", MARKER)
    official = os.path.isdir(os.path.join(site, f"vllm-{OFFICIAL}.dist-info"))
    if os.path.exists(marker) and official:  # the official wheel was reinstalled (nox -R)
        os.remove(marker)
    if os.path.exists(marker):
        with open(marker, encoding="utf-8") as fh:
            return list(json.load(fh)["deltas"])
    if not official:
        raise StandinError(f"{site} does not hold the official vLLM {OFFICIAL}")
    done = []
    for delta in DELTAS:
        delta.apply(site)
        done.append(delta.ident)
        print(f"[standin] applied {delta.ident}: {delta.what}")
    with open(marker, "w", encoding="utf-8") as fh:
        json.dump({"vendor": VENDOR, "deltas": done}, fh)
    return done


if __name__ == "__main__":
    if len(sys.argv) > 2:
        sys.exit("usage: standin.py [VENV_PYTHON]   (default: the python running this script)")
    apply(sys.argv[1] if len(sys.argv) == 2 else sys.executable)
