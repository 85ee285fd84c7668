"""Writes a fake ``vllm`` package tree for one signature family, for CPU unit tests.

The fake has what the shim touches and nothing else: ``vllm.attention.ops.paged_attn`` with a
``PagedAttention`` whose two staticmethods carry the family's exact parameter names (they record
their calls and return a marker), a ``prefix_prefill`` "Triton" module that records being
imported and refuses to run, ``vllm._custom_ops`` with dense-reference ``paged_attention_v1/v2``
(so the native route computes real numbers), and ``*.dist-info`` metadata with the version.
"""

from __future__ import annotations

import os
from typing import Optional

from vllm_bi100_patch.patching import versions

_OPS = '''
"""Fake native ops: a dense reference in plain torch, vLLM's argument order."""
import torch

CALLS = []


def _ref(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
         block_size, max_seq_len, alibi_slopes, kv_cache_dtype, *rest):
    k_scale = float(rest[0])
    v_scale = float(rest[1]) if len(rest) == 7 else k_scale
    num_seqs, num_heads, head_size = query.shape
    group = num_heads // num_kv_heads
    for i in range(num_seqs):
        n = int(seq_lens[i])
        if n == 0:
            out[i].zero_()
            continue
        blocks = block_tables[i, :(n + block_size - 1) // block_size]
        k = key_cache[blocks].permute(0, 3, 1, 2, 4).reshape(-1, num_kv_heads, head_size)[:n]
        v = value_cache[blocks].permute(0, 3, 1, 2).reshape(-1, num_kv_heads, head_size)[:n]
        k = k.float().repeat_interleave(group, dim=1) * k_scale
        v = v.float().repeat_interleave(group, dim=1) * v_scale
        s = torch.einsum("hd,nhd->hn", query[i].float(), k) * scale
        if alibi_slopes is not None:
            s = s + alibi_slopes.float()[:, None] * (torch.arange(n) - (n - 1)).float()[None, :]
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(out.dtype)


def paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables,
                       seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype, *rest):
    CALLS.append(("v1", max_seq_len, rest))
    _ref(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
         block_size, max_seq_len, alibi_slopes, kv_cache_dtype, *rest)


def paged_attention_v2(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache,
                       num_kv_heads, scale, block_tables, seq_lens, block_size, max_seq_len,
                       alibi_slopes, kv_cache_dtype, *rest):
    CALLS.append(("v2", max_seq_len, rest))
    _ref(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
         block_size, max_seq_len, alibi_slopes, kv_cache_dtype, *rest)
'''

#: The block moves of vLLM's ops: stock calls into torch.ops (never judged broken); the vendor
#: style calls ``ixf_F.swap_blocks`` / ``ixf_F.copy_blocks`` on a module that lacks them, as
#: CoreX 3.2.3's ``_custom_ops`` does with its ixformer.
_BLOCK_OPS = {
    "stock": '''

def swap_blocks(src, dst, block_mapping):
    torch.ops._C_cache_ops.swap_blocks(src, dst, block_mapping)


def copy_blocks(key_caches, value_caches, block_mapping):
    torch.ops._C_cache_ops.copy_blocks(key_caches, value_caches, block_mapping)
''',
    "vendor": '''
import types as _types

ixf_F = _types.ModuleType("ixformer.functions")  # an ixformer without the two functions


def swap_blocks(src, dst, block_mapping):
    ixf_F.swap_blocks(src, dst, block_mapping)


def copy_blocks(key_caches, value_caches, block_mapping):
    ixf_F.copy_blocks(key_caches, value_caches, block_mapping)
''',
}

#: PagedAttention.swap_blocks / copy_blocks, as in every official wheel 0.5.x - 0.11.x.
_BLOCK_METHODS = """
    @staticmethod
    def swap_blocks(
        src_kv_cache: torch.Tensor,
        dst_kv_cache: torch.Tensor,
        src_to_dst: torch.Tensor,
    ) -> None:
        src_key_cache = src_kv_cache[0]
        dst_key_cache = dst_kv_cache[0]
        ops.swap_blocks(src_key_cache, dst_key_cache, src_to_dst)

        src_value_cache = src_kv_cache[1]
        dst_value_cache = dst_kv_cache[1]
        ops.swap_blocks(src_value_cache, dst_value_cache, src_to_dst)

    @staticmethod
    def copy_blocks(
        kv_caches: List[torch.Tensor],
        src_to_dists: torch.Tensor,
    ) -> None:
        key_caches = [kv_cache[0] for kv_cache in kv_caches]
        value_caches = [kv_cache[1] for kv_cache in kv_caches]
        ops.copy_blocks(key_caches, value_caches, src_to_dists)
"""

_PREFIX_PREFILL = '''
"""Stands in for vLLM's Triton module: importing it is recorded, running it is an error."""
import os
import sys

sys.modules.setdefault("_fake_triton_log", type(sys)("_fake_triton_log"))
sys.modules["_fake_triton_log"].__dict__.setdefault("imports", []).append(__name__)
if os.environ.get("FAKE_TRITON_IMPORT_MARKER"):
    with open(os.environ["FAKE_TRITON_IMPORT_MARKER"], "a") as fh:
        fh.write("imported\\n")


def context_attention_fwd(*args, **kwargs):
    raise RuntimeError("FAKE TRITON KERNEL LAUNCHED (this would hang a BI-V100)")
'''


# The parameter lists of PagedAttention.forward_decode / forward_prefix as they are written in
# vllm/attention/ops/paged_attn.py of the official wheels (annotations included), one entry per
# signature family. They are typed out here, NOT generated from versions.FAMILIES, so that the
# fakes check that table instead of agreeing with it by construction
# (tests/patching/test_versions.py::test_families_match_the_literal_wheel_signatures).
_DECODE_HEAD = """\
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        kv_cache_dtype: str,
        num_kv_heads: int,
        scale: float,
        alibi_slopes: Optional[torch.Tensor],
"""
_BLOCKSPARSE = """\
        tp_rank: int = 0,
        blocksparse_local_blocks: int = 0,
        blocksparse_vert_stride: int = 0,
        blocksparse_block_size: int = 64,
        blocksparse_head_sliding_step: int = 0,
"""
DECODE_SIGNATURES = {
    # 0.5.0 - 0.5.2
    "v0.5.0": _DECODE_HEAD + "        kv_scale: float,\n" + _BLOCKSPARSE,
    # 0.5.3 - 0.6.6.post1
    "v0.5.3": _DECODE_HEAD + "        k_scale: float,\n        v_scale: float,\n" + _BLOCKSPARSE,
    "v0.5.5": _DECODE_HEAD + "        k_scale: float,\n        v_scale: float,\n" + _BLOCKSPARSE,
    # 0.7.0 - 0.11.0
    "v0.7.0": _DECODE_HEAD + "        k_scale: torch.Tensor,\n        v_scale: torch.Tensor,\n"
    + _BLOCKSPARSE,
    "v0.8.0": _DECODE_HEAD + "        k_scale: torch.Tensor,\n        v_scale: torch.Tensor,\n"
    + _BLOCKSPARSE,
    # 0.11.1 - 0.11.2 (PEP 604)
    "v0.11.1": _DECODE_HEAD.replace("Optional[torch.Tensor]", "torch.Tensor | None")
    + "        k_scale: torch.Tensor,\n        v_scale: torch.Tensor,\n" + _BLOCKSPARSE,
}
PREFIX_SIGNATURES = {
    # 0.5.0 - 0.5.4
    "v0.5.0": """\
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens_tensor: torch.Tensor,
        context_lens: torch.Tensor,
        max_query_len: int,
        alibi_slopes: Optional[torch.Tensor],
        sliding_window: Optional[int],
""",
    # 0.5.5 - 0.6.6.post1
    "v0.5.5": """\
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache_dtype: str,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens_tensor: torch.Tensor,
        context_lens: torch.Tensor,
        max_query_len: int,
        alibi_slopes: Optional[torch.Tensor],
        sliding_window: Optional[int],
        k_scale: float,
        v_scale: float,
""",
    # 0.7.0 - 0.7.3
    "v0.7.0": """\
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache_dtype: str,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens_tensor: torch.Tensor,
        context_lens: torch.Tensor,
        max_query_len: int,
        alibi_slopes: Optional[torch.Tensor],
        sliding_window: Optional[int],
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
""",
    # 0.8.0 - 0.11.0
    "v0.8.0": """\
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache_dtype: str,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens_tensor: torch.Tensor,
        max_query_len: int,
        alibi_slopes: Optional[torch.Tensor],
        sliding_window: Optional[int],
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
""",
    # 0.11.1 - 0.11.2
    "v0.11.1": """\
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache_dtype: str,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens_tensor: torch.Tensor,
        max_query_len: int,
        alibi_slopes: torch.Tensor | None,
        sliding_window: int | None,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
""",
}
PREFIX_SIGNATURES["v0.5.3"] = PREFIX_SIGNATURES["v0.5.0"]


def _override(params) -> str:
    """A signature for tests that break the family on purpose (renamed parameters)."""
    defaults = {"tp_rank": "0", "blocksparse_local_blocks": "0",
                "blocksparse_vert_stride": "0", "blocksparse_block_size": "64",
                "blocksparse_head_sliding_step": "0"}
    return "".join(f"        {p}={defaults[p]},\n" if p in defaults else f"        {p},\n"
                   for p in params)


def _first_arg(signature: str) -> str:
    return signature.split(":", 1)[0].strip()


def paged_attn_source(family: versions.Family, guarded_import: bool = True,
                      decode_params: Optional[tuple] = None,
                      decode_kind: str = "staticmethod") -> str:
    decode = _override(decode_params) if decode_params else DECODE_SIGNATURES[family.name]
    prefix = PREFIX_SIGNATURES[family.name]
    triton_import = ("from vllm.attention.ops.prefix_prefill import context_attention_fwd\n")
    if guarded_import:
        triton_import = "HAS_TRITON = True\nif HAS_TRITON:\n    " + triton_import
    decorator = "@staticmethod" if decode_kind == "staticmethod" else "@classmethod"
    first = "" if decode_kind == "staticmethod" else "        cls,\n"
    lines = [
        f'"""Fake paged_attn ({family.name})."""',
        "from __future__ import annotations  # the fake does not import torch",
        "",
        "from typing import List, Optional",
        "",
        "from vllm import _custom_ops as ops",
        triton_import,
        "STOCK_CALLS = []",
        "",
        "",
        "class PagedAttention:",
        "    @staticmethod",
        "    def get_supported_head_sizes():",
        "        return [64, 80, 96, 112, 120, 128, 192, 256]",
        "",
        f"    {decorator}",
        "    def forward_decode(",
        first + decode + "    ) -> torch.Tensor:",
        '        STOCK_CALLS.append("forward_decode")',
        '        return "stock-decode"',
        "",
        "    @staticmethod",
        "    def forward_prefix(",
        prefix + "    ) -> torch.Tensor:",
        '        STOCK_CALLS.append("forward_prefix")',
        f"        context_attention_fwd({_first_arg(prefix)})",
        '        return "stock-prefix"',
        _BLOCK_METHODS,
    ]
    return "\n".join(lines)


#: ``vllm/attention/backends/utils.py`` with a hand-written ``CommonMetadataBuilder`` whose
#: ``_add_seq_group`` has the shape the ``prefix_block_table`` row reads (the block-table
#: choice of vLLM 0.6.3, ``"bug"``, or of 0.6.4, ``"fixed"``); not vLLM's code, so its
#: fingerprint is not one of the row's known shapes (tests add it).
_BUILDER = '''"""Fake attention-backend utils (the block-table part of the metadata builder)."""


class CommonMetadataBuilder:

    def __init__(self):
        self.block_tables = []
        self.context_lens = []

    def _add_seq_group(self, inter_data, chunked_prefill_enabled):
        is_prompt = inter_data.is_prompt
        block_tables = inter_data.block_tables
        computed_block_nums = inter_data.computed_block_nums
        for seq_id, context_len in zip(inter_data.seq_ids, inter_data.context_lens):
            self.context_lens.append(context_len)
            block_table = []
            if inter_data.prefix_cache_hit:
                block_table = {hit}
            elif (chunked_prefill_enabled or not is_prompt) and block_tables is not None:
                block_table = block_tables[seq_id]
            self.block_tables.append(block_table)


class XFormersMetadataBuilder(CommonMetadataBuilder):
    pass
'''
BUILDERS = {"bug": "computed_block_nums", "fixed": "block_tables[seq_id]"}

#: ``vllm/attention/backends/xformers.py`` with the prompt-attention method's shape as stock
#: vLLM 0.6.3/0.7.3 has it (what row ``dense_prefill``'s opt-in checks); its ``xops`` is the
#: tests' CPU stand-in of xformers (``tests/fakes/fake_xformers`` on the path).
_XFORMERS_BACKEND = '''"""Fake XFormers backend: the prompt-attention method's shape only."""

from xformers import ops as xops


class XFormersImpl:

    def _run_memory_efficient_xformers_forward(self, query, key, value, attn_metadata,
                                               attn_type="decoder"):
        attn_bias = (attn_metadata.seq_lens, self.alibi_slopes, self.sliding_window)
        return xops.memory_efficient_attention_forward(query, key, value, attn_bias=attn_bias,
                                                       scale=self.scale)
'''


def write_fake_vllm(root: str, version: str, family: Optional[versions.Family] = None,
                    with_methods: bool = True, block_ops: str = "stock",
                    metadata_builder: Optional[str] = None, xformers_backend: bool = False,
                    **source_options: object) -> str:
    """Create ``root/vllm`` and ``root/vllm-VERSION.dist-info``; returns root.
    ``metadata_builder`` (``"bug"``/``"fixed"``) adds ``vllm/attention/backends/utils.py``,
    ``xformers_backend`` adds ``vllm/attention/backends/xformers.py`` (stock shape)."""
    fam = family or versions.family_for(versions.VersionInfo(version)) or versions.FAMILIES[-1]
    ops_dir = os.path.join(root, "vllm", "attention", "ops")
    os.makedirs(ops_dir, exist_ok=True)
    files = {
        os.path.join(root, "vllm", "__init__.py"): f'__version__ = "{version}"\n',
        os.path.join(root, "vllm", "attention", "__init__.py"): "",
        os.path.join(ops_dir, "__init__.py"): "",
        os.path.join(root, "vllm", "_custom_ops.py"): _OPS + _BLOCK_OPS[block_ops],
        os.path.join(ops_dir, "prefix_prefill.py"): _PREFIX_PREFILL,
        os.path.join(ops_dir, "paged_attn.py"): (
            paged_attn_source(fam, guarded_import=True, **source_options)  # type: ignore[arg-type]
            if with_methods else
            '"""Fake paged_attn without the methods (0.12+)."""\n\nclass PagedAttention:\n'
            '    pass\n'),
    }
    backends = os.path.join(root, "vllm", "attention", "backends")
    if metadata_builder is not None or xformers_backend:
        os.makedirs(backends, exist_ok=True)
        files[os.path.join(backends, "__init__.py")] = ""
    if metadata_builder is not None:
        files[os.path.join(backends, "utils.py")] = _BUILDER.replace(
            "{hit}", BUILDERS[metadata_builder])
    if xformers_backend:
        files[os.path.join(backends, "xformers.py")] = _XFORMERS_BACKEND
    for path, text in files.items():
        with open(path, "w") as fh:
            fh.write(text)
    dist = os.path.join(root, f"vllm-{version}.dist-info")
    os.makedirs(dist, exist_ok=True)
    with open(os.path.join(dist, "METADATA"), "w") as fh:
        fh.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return root
