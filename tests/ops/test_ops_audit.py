"""``audit``: every ops function that calls a function its module lacks, with the feature
that crashes (or the row that replaces it); the engine-timeout warning."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import types

import pytest

from vllm_bi100_patch.ops import audit
from vllm_bi100_patch.patching.missing_calls import missing_calls
from vllm_bi100_patch.attention import kv_blocks

OPS = '''
import fake_lib as lib
import torch_like

supports_moe_ops = True


def swap_blocks(src, dst, mapping):
    lib.swap_blocks(src, dst, mapping)


def copy_blocks(k, v, mapping):
    lib.copy_blocks(k, v, mapping)


def topk_softmax(w, ids, idx, gating):
    lib.vllm_moe_topk_softmax(w, ids, idx, gating)


def rms_norm(out, x, w, eps):
    lib.rms_norm(x, w, out, eps)
    torch_like.ops.anything(x)


def strange(x):
    lib.not_there(x)
    lib.not_there(x)
    lib.also_missing()
'''


@pytest.fixture
def ops(tmp_path, monkeypatch):
    lib = types.ModuleType("fake_lib")
    lib.copy_blocks = lib.rms_norm = lambda *a: None
    monkeypatch.setitem(sys.modules, "fake_lib", lib)
    monkeypatch.setitem(sys.modules, "torch_like", types.ModuleType("torch_like"))
    path = tmp_path / "fake_custom_ops.py"
    path.write_text(textwrap.dedent(OPS))
    spec = importlib.util.spec_from_file_location("fake_custom_ops", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lists_every_broken_function_once_with_what_it_calls(ops):
    assert audit.broken_ops(ops) == {
        "swap_blocks": ["fake_lib.swap_blocks"],
        "topk_softmax": ["fake_lib.vllm_moe_topk_softmax"],
        "strange": ["fake_lib.not_there", "fake_lib.also_missing"]}
    assert kv_blocks.missing_call(ops.strange) == "fake_lib.not_there"  # the row's check
    assert kv_blocks.missing_call(ops.copy_blocks) is None


def test_a_replaced_function_is_ok_the_rest_fail_naming_the_feature(ops):
    checks = {name: (state, detail) for state, name, detail in
              audit.audit(ops, applied=["decode", "swap_blocks"])}
    assert checks["swap_blocks"][0] == "ok"
    assert "replaced by the shim's row swap_blocks" in checks["swap_blocks"][1]
    assert checks["topk_softmax"] == ("FAIL", "calls fake_lib.vllm_moe_topk_softmax, which does "
                                      "not exist: MoE models (FusedMoE): top-k gating will "
                                      "crash (no patch row replaces it)")
    assert checks["strange"][0] == "FAIL"
    assert "whatever calls fake_custom_ops.strange" in checks["strange"][1]
    assert checks["supports_moe_ops"][0] == "FAIL"
    assert "MoE models (FusedMoE) will crash" in checks["supports_moe_ops"][1]
    unpatched = dict((n, s) for s, n, _ in audit.audit(ops, applied=[]))
    assert unpatched["swap_blocks"] == "FAIL"


def test_a_sound_ops_module_is_ok():
    sound = types.ModuleType("sound_ops")
    assert audit.audit(sound, []) == [("ok", "sound_ops", "every function calls only "
                                           "functions that exist")]


@pytest.mark.parametrize("env,state,text", [
    ({}, "WARN", "60 s (vLLM's default)"),
    ({"VLLM_ENGINE_ITERATION_TIMEOUT_S": "600"}, "WARN", "the field ran 3600"),
    ({"VLLM_ENGINE_ITERATION_TIMEOUT_S": "3600"}, "ok", "3600 s: room for long prompts"),
    ({"VLLM_ENGINE_ITERATION_TIMEOUT_S": "1h"}, "FAIL", "not an integer"),
])
def test_engine_timeout(env, state, text):
    got = audit.timeout_check(["chunked prefill and prefix caching"], env)
    assert got[0] == state and got[1] == "VLLM_ENGINE_ITERATION_TIMEOUT_S" and text in got[2]


#: Calls the audit must not judge (guarded by ``hasattr``, or on a local name that shadows a
#: module global) and two it must: an unguarded call after a guard that does not cover it,
#: and a name whose lookup raises something other than ``AttributeError``.
GUARDS = '''
import fake_lib as lib
import raising_lib as rlib


def guarded(x):
    if hasattr(lib, "maybe"):
        lib.maybe(x)
    return lib.rms_norm(x)


def guarded_in_and(x):
    if x is not None and hasattr(lib, "maybe"):
        return lib.maybe(x)
    return None


def negated_exits(x):
    if not hasattr(lib, "maybe"):
        raise RuntimeError("this build has no maybe")
    return lib.maybe(x)


def negated_else(x):
    if not hasattr(lib, "maybe"):
        return None
    else:
        return lib.maybe(x)


def ternary(x):
    return lib.maybe(x) if hasattr(lib, "maybe") else x


def asserted(x):
    assert hasattr(lib, "maybe"), "this build has no maybe"
    return lib.maybe(x)


def parameter_shadows(lib, x):
    return lib.anything(x)


def local_shadows(x):
    lib = make()
    return lib.anything(x)


def lambda_parameter_shadows(xs):
    return [f(xs) for f in (lambda lib: lib.anything(),)]


def guard_of_another_name(x):
    if hasattr(lib, "other"):
        lib.maybe(x)


def guard_that_does_not_cover(x):
    if hasattr(lib, "maybe"):
        pass
    return lib.maybe(x)


def lookup_raises(x):
    return rlib.thing(x)
'''


class _Raising(types.ModuleType):
    def __getattr__(self, name):
        raise RuntimeError(f"lazy import of {name} failed")


def _guarded_module(tmp_path, monkeypatch, raising: bool):
    lib = types.ModuleType("fake_lib")
    lib.rms_norm = lambda *a: None
    monkeypatch.setitem(sys.modules, "fake_lib", lib)
    monkeypatch.setitem(sys.modules, "raising_lib", _Raising("raising_lib") if raising
                        else types.ModuleType("raising_lib"))
    path = tmp_path / "fake_guarded_ops.py"
    path.write_text(GUARDS)
    spec = importlib.util.spec_from_file_location("fake_guarded_ops", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_guarded_calls_and_shadowing_locals_are_not_judged(tmp_path, monkeypatch):
    broken = audit.broken_ops(_guarded_module(tmp_path, monkeypatch, raising=False))
    assert broken == {"guard_of_another_name": ["fake_lib.maybe"],
                      "guard_that_does_not_cover": ["fake_lib.maybe"],
                      "lookup_raises": ["raising_lib.thing"]}, broken


def test_a_lookup_that_raises_is_reported_not_raised(tmp_path, monkeypatch):
    """``hasattr`` lets anything but AttributeError through: doctor crashed on such a
    module; now the call is reported with what its lookup raises."""
    guards = _guarded_module(tmp_path, monkeypatch, raising=True)
    assert missing_calls(guards.lookup_raises) == [
        "raising_lib.thing (looking it up raises RuntimeError: lazy import of thing failed)"]
    checks = {name: state for state, name, _ in audit.audit(guards, applied=[])}
    assert checks["lookup_raises"] == "FAIL"
