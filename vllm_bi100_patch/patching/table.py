"""Every patch the shim can apply, as data: one row per patch, catalogue entry included.

Adding a patch is one row here (the serving rows: in ``rows_serving``; ``Patch`` itself and
the module names: ``patch_row``) plus its module in the room of its domain, ``attention/``,
``engine/`` or ``serving/`` (its factory, of the type ``patching.factories.Factory``, and for a
conditional patch its ``when`` check) and its test.
Everything else is derived from this table: the names accepted in ``VLLM_BI100_PATCH_DISABLE``
(``config``), the modules the bootstrap hooks (``bootstrap``), the code checks and the
all-or-nothing apply/revert (``registry``), the call counters (``patching.factories``),
``doctor``'s checks and the README's catalogue (``scripts/readme_tables.py``).

Imported at interpreter start by the bootstrap: stdlib only, no typing, no torch, no vLLM.

Row fields:

- ``name``: the patch's name in ``VLLM_BI100_PATCH_DISABLE``, logs and ``status()``.
- ``kind``: ``"wrap_method"`` (a staticmethod replaced by a wrapt wrapper, exact revert),
  ``"wrap_instance_method"`` (a plain function of the class replaced by a wrapt wrapper that
  binds like it, exact revert), ``"replace_class"`` (the module's class replaced by a subclass
  the factory builds, for code that runs inside the class's construction, such as a pydantic
  model's validation; revert puts the original back in the module) or ``"guard_import"`` (a
  ``sys.meta_path`` finder serves a refusing substitute module).
- ``target``: ``"module:Class.attr"`` for a method, ``"module:Class"`` for a class replaced,
  ``"module"`` for an import guard (wrapt's "module:attribute" style).
- ``params``: the code check, for a method: ``"family:<Family attribute>"`` (the parameter
  names depend on the vLLM signature family), ``"names:a,b,c"`` (the same in every family) or
  ``"code:module:function"`` (``function(original)`` returns None or what differs: for code
  whose shape, not only its parameters, the patch relies on).
- ``factory``: ``"module:function"`` building the wrapper (``factory(family, original, module,
  settings)``; for a class replaced, the subclass), or installing the guard.
- ``when``: ``None`` (always applied) or ``"module:function"``; ``function(target_module,
  settings)`` returns None when the patch is needed in this build under the configuration
  (``config.Settings``), else why not (the patch is then skipped, which is not a failure).
- ``counters``: the names of the call counters the row's wrapper adds to (``status()["counts"]``);
  its module takes their handles with ``patching.factories.counter(name)``, which refuses a name
  no row declares (at import, never in a call).
- ``why``, ``how``, ``vllm``, ``upstream``, ``removal``: the catalogue entry.
"""

from __future__ import annotations

from .patch_row import (BACKEND_UTILS, GUARD_IMPORT, LOGITS, MODEL_RUNNER, PAGED_ATTN, REPLACE_CLASS,
                        REPLACE_FUNCTION, SEQUENCE, WRAP_INSTANCE, WRAP_METHOD, XFORMERS, Patch)
from .rows_serving import ROWS as _SERVING_ROWS

TYPE_CHECKING = False  # read at interpreter start: keep it bare
if TYPE_CHECKING:
    from typing import Tuple

_ALL_FAMILIES = "0.5.0 – 0.11.2 (every signature family; the methods are gone in 0.12.0)"

PATCHES: Tuple[Patch, ...] = (
    Patch(
        "import_guard", GUARD_IMPORT, "vllm.attention.ops.prefix_prefill",
        "vllm_bi100_patch.attention.import_guard:install",
        why="its Triton kernel `context_attention_fwd` (chunked prefill, prefix caching) hangs "
            "the BI-V100 card until reboot; from vLLM 0.6.5 importing the module also queries "
            "the device",
        how="a `sys.meta_path` finder installed first at activation serves a substitute module "
            "whose `context_attention_fwd` raises `TritonPrefixBlocked` naming the caller; "
            "names already bound to the real kernel are re-pointed (and restored on revert)",
        vllm="0.5.0 – 0.11.2 (imported by paged_attn.py, and by "
             "chunked_prefill_paged_decode.py from 0.8.0)",
        upstream="no fix; Iluvatar's stack has no working Triton for this kernel",
        removal="drop the row once Iluvatar ships a Triton that runs the kernel"),
    Patch(
        "decode", WRAP_METHOD, PAGED_ATTN + ":PagedAttention.forward_decode",
        "vllm_bi100_patch.attention.paged_attention:make_decode_wrapper",
        params="family:decode_params", counters=("forward_decode",),
        why="the native `paged_attention_v1` keeps a whole sequence's logits in shared memory "
            "and hangs BI-V100 above 32,768 tokens; Iluvatar's build forces V1, stubs V2 and "
            "takes other arguments than stock vLLM",
        how="reads the family's arguments by name into one decode call for the `native` "
            "decoder built at patch time: the "
            "native kernels as the installed build defines them, where they exist and are "
            "safe (V1 within its length limit, the BI-V100 occupancy rule between V1 and V2), "
            "else the pure-PyTorch `paged_decode`",
        vllm=_ALL_FAMILIES,
        upstream="none; the method is gone in 0.12.0 (V0 engine removed)",
        removal="when Iluvatar's build fixes long-context V1 and its dispatch"),
    Patch(
        "prefix", WRAP_METHOD, PAGED_ATTN + ":PagedAttention.forward_prefix",
        "vllm_bi100_patch.attention.paged_attention:make_prefix_wrapper",
        params="family:prefix_params", counters=("forward_prefix",),
        why="the stock method launches the Triton `context_attention_fwd`, which hangs "
            "BI-V100 (on CoreX 3.2.3 it is not even imported: `NameError`)",
        how="always the pure-PyTorch `paged_prefix`, tiled under `VLLM_BI100_PREFIX_BUDGET_MB`; "
            "`context_lens` derived where the family lacks it, `\"auto\"`/1.0 where it lacks "
            "`kv_cache_dtype`/scales",
        vllm=_ALL_FAMILIES,
        upstream="none; gone in 0.12.0",
        removal="when a Triton that runs `context_attention_fwd` ships on CoreX"),
    Patch(
        "swap_blocks", WRAP_METHOD, PAGED_ATTN + ":PagedAttention.swap_blocks",
        "vllm_bi100_patch.attention.kv_blocks:make_swap_wrapper",
        params="names:src_kv_cache,dst_kv_cache,src_to_dst",
        when="vllm_bi100_patch.attention.kv_blocks:swap_needed", counters=("swap_blocks",),
        why="CoreX 3.2.3's `_custom_ops.swap_blocks` calls `ixformer.functions.swap_blocks`, "
            "which its ixformer lacks: the first preemption by swapping (n > 1, beam search "
            "under memory pressure) crashes the server",
        how="only where the build's ops call a function their module does not define: KV "
            "blocks move with `index_select`/`index_copy_` in bounded chunks "
            "(`kernels.blocks.swap_blocks`), bit-exact",
        vllm=_ALL_FAMILIES + "; applied only on builds whose ops cannot swap",
        upstream="Iluvatar's build; ixformer has `vllm_swap_blocks(src, dst, mapping)` taking "
                 "a dict instead",
        removal="when Iluvatar's `_custom_ops.swap_blocks` calls a function ixformer has"),
    Patch(
        "copy_blocks", WRAP_METHOD, PAGED_ATTN + ":PagedAttention.copy_blocks",
        "vllm_bi100_patch.attention.kv_blocks:make_copy_wrapper",
        params="names:kv_caches,src_to_dists",
        when="vllm_bi100_patch.attention.kv_blocks:copy_needed", counters=("copy_blocks",),
        why="CoreX 3.2.3's `_custom_ops.copy_blocks` calls `ixformer.functions.copy_blocks`; "
            "where an ixformer lacks it (the public listing of 3.2.3's `ixformer` shows only "
            "`vllm_copy_cache`), copy-on-write of a shared block (parallel sampling, beam "
            "search) crashes the server",
        how="only where the build's ops call a function their module does not define: "
            "`kernels.blocks.copy_blocks` in every layer's cache",
        vllm=_ALL_FAMILIES + "; applied only on builds whose ops cannot copy",
        upstream="Iluvatar's build",
        removal="when Iluvatar's `_custom_ops.copy_blocks` calls a function ixformer has"),
    Patch(
        "kv_write", WRAP_METHOD, PAGED_ATTN + ":PagedAttention.write_to_paged_cache",
        "vllm_bi100_patch.attention.kv_write:make_write_wrapper",
        params="names:key,value,key_cache,value_cache,slot_mapping,kv_cache_dtype,k_scale,"
               "v_scale",
        when="vllm_bi100_patch.attention.kv_write:write_needed", counters=("kv_write_fp8",),
        why="CoreX 3.2.3's `_custom_ops.reshape_and_cache` takes `kv_cache_dtype` and the "
            "scales and drops them: with `--kv-cache-dtype fp8` the cache would not hold fp8 "
            "values and every decode and prefix would read garbage",
        how="only where the build's `reshape_and_cache` never reads its `kv_cache_dtype` or "
            "one of its scales (the dtype passed on without the scales would give fp8 bytes "
            "that the shim reads back with scales): fp8 "
            "caches are written in PyTorch (`kernels.kv_write`: `fp8(x / scale)` saturated, "
            "vLLM's bytes and layout, slot -1 skipped), read back by the shim's decode and "
            "prefix; `auto` keeps the build's write; any other dtype is refused naming "
            "`--kv-cache-dtype`",
        vllm="0.5.3 – 0.11.2 (k_scale/v_scale families); applied only on builds whose ops drop "
             "the cache dtype",
        upstream="Iluvatar's build",
        removal="when Iluvatar's `reshape_and_cache` passes the dtype and scales on"),
    Patch(
        "dense_prefill", WRAP_INSTANCE,
        XFORMERS + ":XFormersImpl._run_memory_efficient_xformers_forward",
        "vllm_bi100_patch.attention.dense_prefill:make_dense_wrapper",
        params="names:self,query,key,value,attn_metadata,attn_type",
        when="vllm_bi100_patch.attention.dense_prefill:dense_needed",
        counters=("dense_prefill", "dense_vendor"),
        why="CoreX 3.2.3's XFormers backend runs every prompt without a cached prefix, and "
            "vLLM's memory-profiling run at start-up, through `ixformer.contrib.xformers`' "
            "flash `FwOp`, which fails above head size 128: a causal bias raises, a mask "
            "returns wrong values silently; a head-256 model cannot start, or answers garbage. "
            "And wherever the backend's own kernel computes a prompt (a batch without context: "
            "whole prompts, chunked prefill off as CoreX 3.2.3 runs it up to 32K tokens), the "
            "same prompt sent again gets its rows from the shim's prefix kernel (its "
            "prefix-cache hit): two kernels, which differ in the last bits, so a greedy "
            "completion can change",
        how="only where the backend's `xops` is ixformer's and the method passes "
            "`xops.fmha.flash.FwOp()` as `op=`: head sizes above `VLLM_BI100_DENSE_HEAD_MAX` "
            "(128) go to the pure-PyTorch varlen attention `kernels.prefill.dense` (causal, GQA, "
            "sliding window, ALiBi; encoder and cross-attention unmasked), tiled over queries "
            "under `VLLM_BI100_PREFIX_BUDGET_MB`; smaller heads keep the vendor kernel. With "
            "`VLLM_BI100_PROMPT_ATTENTION=shim` (opt-in) every head size goes to "
            "`kernels.prefill.dense`, also on stock XFormers backends whose method has the checked "
            "shape (its parameters, the `xops` call with `attn_bias=`, the reads the wrapper "
            "stands in for): every prompt and prefix attention is then the shim's, "
            "bit-identical however vLLM slices the prompt; another shape: the row is skipped "
            "with one WARNING and `status()`/`doctor` say the guarantee does not hold",
        vllm="0.6.3 (the XFormers backend's method as CoreX 3.2.3 ships it); applied only on "
             "builds whose backend calls ixformer's `FwOp`; with the opt-in also stock "
             "0.6.3 – 0.7.3 (code checked against 0.6.3.post1 and 0.7.3; driven through "
             "vLLM's scheduler and input builder on both and on CoreX 3.2.3)",
        upstream="Iluvatar's build (ixformer's flash attention above head size 128); the "
                 "opt-in: none (two kernels never agree bit for bit)",
        removal="when ixformer's `FwOp` handles head sizes above 128 (the opt-in stays while "
                "the prefix kernel is the shim's)"),
    Patch(
        "prefix_block_table", WRAP_INSTANCE,
        BACKEND_UTILS + ":CommonMetadataBuilder._add_seq_group",
        "vllm_bi100_patch.engine.block_tables:make_wrapper",
        params="code:vllm_bi100_patch.engine.block_tables:check",
        when="vllm_bi100_patch.engine.block_tables:fix_needed", counters=("prefix_block_table",),
        why="with chunked prefill and prefix caching (vLLM 0.6.3, so CoreX 3.2.3 too, turns "
            "chunked prefill on by itself above 32K context unless the model is multimodal or "
            "uses a sliding window, speculative decoding, LoRA or prompt adapters), every "
            "chunk after a prompt's cached prefix keeps `prefix_cache_hit` "
            "and gets `computed_block_nums` (the cached blocks only) as its block table: "
            "alone in a batch the prefix kernel refuses the short table (every request "
            "fails), batched its row is zero-padded and block 0 is read as context "
            "(silently wrong tokens)",
        how="while the original runs for a group with a prefix-cache hit, the group's "
            "`computed_block_nums` is its sequence's own block table, so the method appends "
            "`block_tables[seq_id]` exactly as vLLM 0.6.4 does; only where the method still "
            "assigns `block_table = computed_block_nums`, on the code shape it was checked "
            "against",
        vllm="0.5.4 – 0.6.3 (code checked against each of them; driven through vLLM's "
             "scheduler and input builder on 0.6.3.post1 and CoreX 3.2.3); not applied from "
             "0.6.4 (fixed upstream)",
        upstream="vLLM pull request #9532 (\"Fix illegal memory access error with chunked "
                 "prefill, prefix caching, block manager v2 and xformers enabled together\"), "
                 "in 0.6.4",
        removal="when the oldest vLLM the shim supports is 0.6.4, or Iluvatar's build "
                "carries the fix (the row then reports itself not needed)"),
    Patch(
        "tp_empty_logits", WRAP_INSTANCE, LOGITS + ":LogitsProcessor.forward",
        "vllm_bi100_patch.engine.logits_gather:make_wrapper",
        params="code:vllm_bi100_patch.engine.logits_gather:check",
        when="vllm_bi100_patch.engine.logits_gather:logits_needed", counters=("tp_empty_logits",),
        why="with tensor parallelism, CoreX 3.2.3's `LogitsProcessor.forward` builds an empty "
            "logits tensor when no token of the step samples (each non-final chunk of a prompt "
            "longer than `max_num_batched_tokens` under chunked prefill); ranks > 0 get "
            "`seq_groups=None`, stock vLLM's gather gives them None, the vendor's empty tensor "
            "is not None, so `_apply_logits_processors` iterates None: `TypeError: 'NoneType' "
            "object is not iterable`, the worker dies, and with it the engine",
        how="on a rank without sequence groups and with no token selected, returns None (what "
            "stock vLLM returns on ranks > 0; no rank gathers in that case, so no collective "
            "changes); every other call runs the vendor's method; only where `forward` has the "
            "vendor's empty-tensor branch, on the code shape it was checked against",
        vllm="0.6.3+corex.3.2.3 (the vendor's method; driven through vLLM's worker broadcast "
             "with two gloo ranks on the stand-in); no official release has the branch",
        upstream="Iluvatar's build (stock vLLM gathers and returns None on ranks > 0)",
        removal="when Iluvatar's `LogitsProcessor.forward` gathers, or returns None without "
                "sequence groups (the row then reports itself not needed)"),
    Patch(
        "stream_delta", WRAP_INSTANCE, SEQUENCE + ":Sequence.get_output_token_ids_to_return",
        "vllm_bi100_patch.engine.stream_delta:make_wrapper",
        params="code:vllm_bi100_patch.engine.stream_delta:check",
        when="vllm_bi100_patch.engine.stream_delta:delta_needed", counters=("stream_delta",),
        why="a streamed request's (`RequestOutputKind.DELTA`) output of a step without a new "
            "token (each non-final chunk of a chunked prefill) returns "
            "`_cached_all_token_ids[-0:]`, the whole prompt, as new tokens: wrong streamed "
            "token ids, usage counts and logprob slices (CoreX 3.2.3 ships vLLM 0.6.2's "
            "method, which lacks 0.6.3's `num_new_tokens == 0` case)",
        how="returns `[]` when the sequence's output length equals the offset it last "
            "returned (exactly 0.6.3's case), else the original; only where the method slices "
            "`[-num_new_tokens:]` without that case, on the code shape it was checked against",
        vllm="0.6.2, 0.6.3+corex.3.2.3 (code checked against both; driven through vLLM's "
             "scheduler and `RequestOutputFactory` on the stand-in); not applied from 0.6.3 "
             "(it has the case)",
        upstream="vLLM 0.6.3 (`if num_new_tokens == 0: return []` in `vllm/sequence.py`)",
        removal="when Iluvatar's `Sequence` is 0.6.3's or later (the row then reports itself "
                "not needed)"),
    Patch(
        "mrope_positions", WRAP_INSTANCE,
        MODEL_RUNNER + ":ModelInputForGPUBuilder._compute_multi_modal_input",
        "vllm_bi100_patch.engine.mrope_positions:make_wrapper",
        params="code:vllm_bi100_patch.engine.mrope_positions:check",
        when="vllm_bi100_patch.engine.mrope_positions:mrope_needed", counters=("mrope_positions",),
        why="for MRoPE models (Qwen2-VL style) with chunked prefill, or a prefix-cache hit "
            "inside a chunk, the model-input builder gives a chunk the multimodal rotary "
            "positions of the whole rest of the request: more positions than tokens, and the "
            "rotary embedding kills the engine (`RuntimeError: shape '[26540, -1, 256]' is "
            "invalid` in the field) or, where the counts divide, rotates with wrong positions "
            "silently",
        how="after the original, a chunk keeps exactly the positions of its tokens: the "
            "builder's own (from the chunk's context) cut to its token count, as vLLM 0.6.5 "
            "slices `[context_len:seq_len]`; positions made from the request's delta before a "
            "prefix-cache hit dropped tokens cropped to the kept suffix and checked against "
            "the delta; only where `get_input_positions` is called without `seq_len`, on the "
            "code shapes it was checked against",
        vllm="0.6.1.post2 – 0.6.4.post1 (code checked against 0.6.1.post2, 0.6.2, "
             "0.6.3.post1, 0.6.4.post1; driven through vLLM's scheduler, input builder and "
             "`MRotaryEmbedding` on 0.6.3.post1 and CoreX 3.2.3); not applied from 0.6.5 "
             "(fixed upstream)",
        upstream="vLLM pull requests #10388 (\"Fix M-RoPE position calculation when chunked "
                 "prefill is enabled\") and #10403 (\"Fix mrope_position_delta in non-last "
                 "prefill chunk\"), in 0.6.5",
        removal="when the oldest vLLM the shim supports is 0.6.5, or Iluvatar's build carries "
                "the fix (the row then reports itself not needed)"),
    *_SERVING_ROWS,
)


def names() -> Tuple[str, ...]:
    """Every patch name, in table order (``VLLM_BI100_PATCH_DISABLE`` accepts these)."""
    return tuple(p.name for p in PATCHES)


def methods() -> Tuple[Patch, ...]:
    """The rows patched when their module is imported: a method wrapped (static or plain), a
    class replaced, or a function wrapped."""
    return tuple(p for p in PATCHES
                 if p.kind in (WRAP_METHOD, WRAP_INSTANCE, REPLACE_CLASS, REPLACE_FUNCTION))


def guards() -> Tuple[Patch, ...]:
    return tuple(p for p in PATCHES if p.kind == GUARD_IMPORT)


def guard_installed(name: str) -> bool:
    """Whether the import guard row ``name`` is installed: its factory's module, when loaded,
    says so (``installed()``); a guard whose module never loaded is not installed."""
    import sys

    for row in guards():
        if row.name == name:
            module = sys.modules.get(row.factory.partition(":")[0])
            return module is not None and bool(module.installed())
    return False


def hooked_modules() -> Tuple[str, ...]:
    """The distinct modules whose import triggers patching, in table order."""
    out = []
    for p in methods():
        if p.module not in out:
            out.append(p.module)
    return tuple(out)


def by_name(name: str) -> Patch:
    for p in PATCHES:
        if p.name == name:
            return p
    raise KeyError(name)


def resolve(path: str) -> object:
    """Import ``"module:attribute"`` and return the attribute."""
    import importlib

    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def catalogue() -> str:
    """The README's catalogue of patches, generated from the table."""
    rows = ["| patch | target | why | how | vLLM | upstream | removal |",
            "|---|---|---|---|---|---|---|"]
    for p in PATCHES:
        kind = {GUARD_IMPORT: "import guard", WRAP_INSTANCE: "instance method",
                REPLACE_CLASS: "class", REPLACE_FUNCTION: "function"}.get(p.kind, "method")
        rows.append(f"| `{p.name}` ({kind}) | `{p.target}` | {p.why} | {p.how} | {p.vllm} | "
                    f"{p.upstream} | {p.removal} |")
    return "\n".join(rows)
