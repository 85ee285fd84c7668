"""Replacements for ``PagedAttention.swap_blocks`` and ``copy_blocks`` on builds that cannot.

Catalogue entries: rows ``swap_blocks`` and ``copy_blocks`` of ``vllm_bi100_patch.patching.table``.

Iluvatar's CoreX 3.2.3 build routes both through ``ixformer.functions`` names its ixformer does
not define (``docs/corex-3.2.3.md``).  The rows are conditional: ``swap_needed`` /
``copy_needed`` read the source of the build's ``ops.swap_blocks`` / ``ops.copy_blocks`` once,
at patch time, and report the patch as needed only when that function calls
``<module>.<name>(...)`` on a module global that has no such name.  Stock vLLM's ops (calls into
``torch.ops``) are never judged broken, so stock builds keep their native block moves.
Imported only once vLLM's ``paged_attn`` is; never imports vLLM itself.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Dict, Optional, Tuple

from ..activation import config
from ..patching.missing_calls import missing_calls
from .kernels import blocks
from ..patching.versions import Family
from ..patching.factories import ArgReader, Wrapper, counter

SWAP_PARAMS = ("src_kv_cache", "dst_kv_cache", "src_to_dst")
COPY_PARAMS = ("kv_caches", "src_to_dists")
SWAP_CALLS = counter("swap_blocks")
COPY_CALLS = counter("copy_blocks")


def missing_call(func: Callable[..., Any]) -> Optional[str]:
    """The first ``"module.name"`` that ``func`` calls on a module global lacking ``name``
    (``missing_calls``, which doctor runs over every ops function); None when there
    is none or the source cannot be read."""
    missing = missing_calls(func)
    return missing[0] if missing else None


def _needed(module: types.ModuleType, op: str) -> Optional[str]:
    ops = vars(module).get("ops")
    func = getattr(ops, op, None) if ops is not None else None
    if func is None:
        return f"{module.__name__} binds no ops.{op}: nothing to replace"
    missing = missing_call(func)
    if missing is None:
        return f"the build's ops.{op} calls only functions that exist"
    return None


def swap_needed(module: types.ModuleType, settings: config.Settings) -> Optional[str]:
    """None when this build's ``ops.swap_blocks`` cannot work, else why the patch is not
    needed."""
    return _needed(module, "swap_blocks")


def copy_needed(module: types.ModuleType, settings: config.Settings) -> Optional[str]:
    """None when this build's ``ops.copy_blocks`` cannot work, else why not needed."""
    return _needed(module, "copy_blocks")


def make_swap_wrapper(family: Family, original: Callable[..., Any], module: types.ModuleType,
                      settings: config.Settings) -> Wrapper:
    reader = ArgReader.for_function(original, SWAP_PARAMS, "swap_blocks", SWAP_CALLS)

    def swap_blocks(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                    kwargs: Dict[str, Any]) -> None:
        src, dst, mapping = reader.read(args, kwargs)
        blocks.swap_blocks(src, dst, mapping)

    return swap_blocks


def make_copy_wrapper(family: Family, original: Callable[..., Any], module: types.ModuleType,
                      settings: config.Settings) -> Wrapper:
    reader = ArgReader.for_function(original, COPY_PARAMS, "copy_blocks", COPY_CALLS)

    def copy_blocks(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                    kwargs: Dict[str, Any]) -> None:
        kv_caches, mapping = reader.read(args, kwargs)
        blocks.copy_blocks(kv_caches, mapping)

    return copy_blocks
