"""Replacement for ``PagedAttention.write_to_paged_cache`` on builds whose ops drop the dtype.

Catalogue entry: row ``kv_write`` of ``vllm_bi100_patch.patching.table``.

CoreX 3.2.3's ``_custom_ops.reshape_and_cache`` takes ``kv_cache_dtype``, ``k_scale`` and
``v_scale`` and never reads them (it calls ``ixformer.functions.vllm_cache_ops_reshape_and_cache``
without them, ``docs/corex-3.2.3.md``): with ``--kv-cache-dtype fp8`` the cache would not hold
fp8 values.  The row is conditional: ``write_needed`` reads the source of the build's
``ops.reshape_and_cache`` once, at patch time, and reports the patch as needed only when it has
a ``kv_cache_dtype``, ``k_scale`` or ``v_scale`` parameter its body never reads (a build that
passes the dtype on but drops the scales writes fp8 bytes the shim's decode and prefix would
read back with scales).  The wrapper writes fp8 caches with
``kernels.kv_write.write_fp8`` (vLLM's bytes) and leaves ``"auto"`` caches to the build's own
write; any other ``kv_cache_dtype`` is refused with an error naming ``--kv-cache-dtype``.
Never imports vLLM.
"""

from __future__ import annotations

import ast
import types
from typing import Any, Callable, Dict, Optional, Tuple

from ..activation import config
from .kernels import kv_write
from ..patching.source import function_def
from ..patching.versions import Family
from ..patching.factories import ArgReader, Wrapper, counter

PARAMS = ("key", "value", "key_cache", "value_cache", "slot_mapping", "kv_cache_dtype",
          "k_scale", "v_scale")

FP8_WRITES = counter("kv_write_fp8")


def ignores_parameter(func: Callable[..., Any], name: str) -> Optional[bool]:
    """True when ``func`` has a parameter ``name`` that its body never reads, False when it
    reads it, None when the source cannot be read or there is no such parameter."""
    fn = function_def(func)
    if fn is None:
        return None
    params = [a.arg for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs]
    if name not in params:
        return None
    reads = any(isinstance(n, ast.Name) and n.id == name for stmt in fn.body
                for n in ast.walk(stmt))
    return not reads


#: What the build's ``reshape_and_cache`` must pass on for its own write to be right.
PASSED_ON = ("kv_cache_dtype", "k_scale", "v_scale")


def write_needed(module: types.ModuleType, settings: config.Settings) -> Optional[str]:
    """None when this build's ``ops.reshape_and_cache`` drops ``kv_cache_dtype`` or one of
    the scales (an fp8 cache written without its scales would be read back with them), else
    why the patch is not needed."""
    ops = vars(module).get("ops")
    func = getattr(ops, "reshape_and_cache", None) if ops is not None else None
    if func is None:
        return f"{module.__name__} binds no ops.reshape_and_cache: nothing to replace"
    ignored = {name: ignores_parameter(func, name) for name in PASSED_ON}
    if ignored["kv_cache_dtype"] is None:
        return "the build's ops.reshape_and_cache has no readable kv_cache_dtype parameter"
    if any(ignored.values()):
        return None
    return "the build's ops.reshape_and_cache passes kv_cache_dtype and the scales on"


def make_write_wrapper(family: Family, original: Callable[..., Any], module: types.ModuleType,
                       settings: config.Settings) -> Wrapper:
    reader = ArgReader.for_function(original, PARAMS, "write_to_paged_cache")

    def write_to_paged_cache(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                             kwargs: Dict[str, Any]) -> None:
        key, value, key_cache, value_cache, slots, dtype, k_scale, v_scale = reader.read(args,
                                                                                       kwargs)
        if dtype == "auto":
            return wrapped(*args, **kwargs)
        if dtype not in kv_write.FP8_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {dtype}: this build's reshape_and_cache drops "
                             "the cache dtype and the shim writes only "
                             f"{', '.join(kv_write.FP8_CACHE_DTYPES)} (or auto) caches")
        FP8_WRITES.add()
        kv_write.write_fp8(key, value, key_cache, value_cache, slots, dtype, k_scale, v_scale)
        return None

    return write_to_paged_cache
