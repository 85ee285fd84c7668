"""The ``kv_write`` row's condition: needed wherever the build's ``reshape_and_cache`` drops
the cache dtype or a scale (an fp8 cache written without its scales is read back with them by
the shim's decode and prefix), not needed where it passes all three on."""

from __future__ import annotations

import importlib.util
import types

import pytest

from vllm_bi100_patch.activation import config
from vllm_bi100_patch.attention import kv_write

HEAD = ("def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,"
        " k_scale, v_scale):\n")


def _module(tmp_path, body: str):
    path = tmp_path / "fake_kv_ops.py"
    path.write_text(HEAD + body)
    spec = importlib.util.spec_from_file_location("fake_kv_ops", path)
    ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ops)
    mod = types.ModuleType("vllm.attention.ops.paged_attn")
    mod.ops = ops
    return mod


@pytest.mark.parametrize("args,needed", [
    ("", True),  # CoreX 3.2.3: neither the dtype nor the scales
    (", kv_cache_dtype", True),  # the dtype passed on, the scales dropped
    (", kv_cache_dtype, k_scale", True),
    (", kv_cache_dtype, k_scale, v_scale", False),  # stock vLLM
])
def test_needed_unless_the_dtype_and_both_scales_are_passed_on(tmp_path, args, needed):
    mod = _module(tmp_path, f"    lib.write(key, value, key_cache, value_cache, slot_mapping{args})\n")
    why = kv_write.write_needed(mod, config.load({}))
    if needed:
        assert why is None
    else:
        assert why == "the build's ops.reshape_and_cache passes kv_cache_dtype and the scales on"
