"""The ``replace_function`` row kind (``patch_row.REPLACE_FUNCTION``) through the registry: a
module's function wrapped where it is defined and wherever a loaded module bound it, checked
before, never wrapped twice, disabled by name, put back exactly by revert."""

from __future__ import annotations

import importlib
import types

from vllm_bi100_patch.activation import config
from vllm_bi100_patch.patching import patch_row, registry, specs, table

ON = config.load({config.MODE: "1"})


def _row(monkeypatch, check="bi100_test_fn_factories:check"):
    module = types.ModuleType("vllm.bi100_test_app")

    def build(x):
        return [x]

    module.build = build
    elsewhere = types.ModuleType("vllm.bi100_test_user")  # `from ..app import build`
    elsewhere.build = build
    factories = types.ModuleType("bi100_test_fn_factories")
    calls = []

    def factory(family, original, mod, settings):
        assert original is build and mod is module

        def wrapper(wrapped, instance, args, kwargs):
            calls.append(args)
            return wrapped(*args, **kwargs) + ["wrapped"]

        return wrapper

    factories.factory = factory
    factories.check = lambda func: None if func.__name__ == "build" else "another function"
    factories.refuse = lambda func: "the code differs"
    for name, mod in (("vllm.bi100_test_app", module), ("vllm.bi100_test_user", elsewhere),
                      ("bi100_test_fn_factories", factories)):
        monkeypatch.setitem(importlib.sys.modules, name, mod)
    row = patch_row.Patch("build_route", patch_row.REPLACE_FUNCTION, "vllm.bi100_test_app:build",
                          "bi100_test_fn_factories:factory", params="code:" + check, why="w",
                          how="h", vllm="v", upstream="u", removal="r")
    monkeypatch.setattr(table, "PATCHES", table.PATCHES + (row,))
    monkeypatch.setattr(specs, "SPECS", tuple(specs.PatchSpec(r) for r in table.methods()))
    return module, elsewhere, build, calls


def test_a_function_row_wraps_rebinds_and_reverts(paged_attn_module, monkeypatch):
    paged_attn_module("0.6.3.post1")
    module, elsewhere, build, calls = _row(monkeypatch)
    assert "vllm.bi100_test_app" in table.hooked_modules()
    report = registry.apply_to(module, ON)
    assert report.reason is None and report.applied == ["build_route"], report
    assert module.build is not build and module.build(1) == [1, "wrapped"]
    assert elsewhere.build is module.build  # the binding made before the patch
    assert calls == [(1,)]
    assert module.build.__name__ == "build" and module.build.__wrapped__ is build
    again = module.build
    assert registry.apply_to(module, ON).applied == ["build_route"] and module.build is again
    assert "| `build_route` (function) |" in table.catalogue()
    registry.revert_all()
    assert module.build is build and elsewhere.build is build
    off = config.load({config.MODE: "1", config.DISABLE: "build_route"})
    assert registry.apply_to(module, off).skipped["build_route"].startswith("disabled")
    assert module.build is build


def test_a_function_row_whose_code_check_fails_patches_nothing(paged_attn_module, monkeypatch):
    paged_attn_module("0.6.3.post1")
    module, elsewhere, build, _ = _row(monkeypatch, check="bi100_test_fn_factories:refuse")
    report = registry.apply_to(module, ON)
    assert report.applied == [] and "the code differs" in report.reason
    assert module.build is build and elsewhere.build is build


def test_a_missing_function_is_named(paged_attn_module, monkeypatch):
    paged_attn_module("0.6.3.post1")
    module, _, _, _ = _row(monkeypatch)
    del module.build
    report = registry.apply_to(module, ON)
    assert report.applied == [] and "vllm.bi100_test_app has no build" in report.reason
