"""The layers stay visible: ``kernels/`` is a leaf (torch and the package logger only, no vLLM
parameter names); the native decoder never imports vLLM, and its route table and decoder never
import each other; the code checks parse source through one neutral module."""

from __future__ import annotations

import ast
import glob
import os

from helpers.shim import ROOT

PKG = os.path.join(ROOT, "vllm_bi100_patch")
#: forward_decode's parameters that only vLLM and its native kernels know.
VLLM_NAMES = ("tp_rank", "blocksparse", "head_mapping", "kv_scale", "_custom_ops")


def _imports(path):
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((0, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.level, node.module or ""


def _kernel_modules():
    """(path, depth below vllm_bi100_patch) of every kernels module, its packages' too."""
    for path in sorted(glob.glob(os.path.join(PKG, "kernels", "**", "*.py"), recursive=True)):
        yield path, os.path.relpath(path, PKG).count(os.sep)


def _relative_targets(path):
    """(level, dotted module) of each relative import: ``from . import x`` names ``x``."""
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.module:
                yield node.level, node.module
            else:
                yield from ((node.level, a.name) for a in node.names)


def test_kernels_import_only_torch_and_the_logger():
    for path, depth in _kernel_modules():
        for level, name in _imports(path):
            if level == 0:
                assert name.split(".")[0] in ("torch", "math", "typing", "dataclasses",
                                              "__future__", "functools", "os",
                                              "collections"), (path, name)
            elif level > depth:  # out of kernels/: the package logger only
                assert name == "_log", (path, name)


def test_decode_and_prefill_stay_in_their_packages():
    """A walk through decode never enters prefill, nor the other way round, and the shared
    modules beside them use neither; nothing imports a kernels package's face from below."""
    for path, depth in _kernel_modules():
        here = os.path.relpath(path, os.path.join(PKG, "kernels")).split(os.sep)
        package = here[0] if len(here) > 1 else None
        if here == ["__init__.py"]:
            continue  # kernels' face imports the packages it presents
        for level, name in _relative_targets(path):
            if level > depth:
                continue
            base = here[:-1][:len(here) - level]  # the importing package, ``level - 1`` up
            target = base + name.split(".")
            if package is None:
                assert target[0] not in ("decode", "prefill"), (path, name)
            else:
                other = {"decode": "prefill", "prefill": "decode"}[package]
                assert target[0] != other, (path, name)
                assert target != [package], (path, "imports its own package's face")


def test_no_module_imports_the_package_face():
    """``vllm_bi100_patch/__init__.py`` is the top: no module of the package imports from it
    (the version lives in ``_version``)."""
    for path in glob.glob(os.path.join(PKG, "**", "*.py"), recursive=True):
        depth = os.path.relpath(path, PKG).count(os.sep)
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.ImportFrom) and node.level == depth + 1 and not node.module:
                names = {a.name for a in node.names}
                assert "__version__" not in names and "apply" not in names, (path, names)
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module != "vllm_bi100_patch", path


def test_leaf_modules_never_import_the_registry_or_doctor():
    for leaf in ("ops_audit", "metrics_export", "metrics", "counters", "source", "config",
                 "table", "versions", "hardware"):
        for level, name in _imports(os.path.join(PKG, leaf + ".py")):
            assert not (level == 1 and name.split(".")[0] in ("registry", "doctor")), (leaf, name)


def test_the_native_decoder_never_imports_vllm():
    for path in glob.glob(os.path.join(PKG, "native", "*.py")):
        for level, name in _imports(path):
            assert not (level == 0 and name.split(".")[0] == "vllm"), (path, name)


def test_route_table_and_decoder_never_import_each_other():
    """Not even for types: ``native.build`` hands the decoder its route table."""
    native = os.path.join(PKG, "native")
    for here, other in (("routes", "decoder"), ("decoder", "routes")):
        for level, name in _imports(os.path.join(native, here + ".py")):
            assert not (level == 1 and name.split(".")[0] == other), (here, name)
            assert not (level == 0 and name.startswith("vllm_bi100_patch.native." + other))
            assert not (level == 2 and name.startswith("native." + other)), (here, name)


def test_code_checks_parse_source_through_the_neutral_module():
    for level, name in _imports(os.path.join(PKG, "source.py")):
        assert level == 0 and name.split(".")[0] in ("__future__", "ast", "inspect",
                                                     "textwrap", "threading", "typing"), name
    users = [os.path.join(PKG, "ops_audit.py")] + glob.glob(os.path.join(PKG, "patches", "*.py"))
    for path in users:
        text = open(path, encoding="utf-8").read()
        assert "native import probe" not in text and "probe." not in text, path


def test_every_package_module_fits_in_350_lines():
    """A module a reader can hold in mind: at most 350 lines (issue 29)."""
    long = {os.path.relpath(p, ROOT): n for p in glob.glob(os.path.join(PKG, "**", "*.py"),
                                                           recursive=True)
            if (n := len(open(p, encoding="utf-8").read().splitlines())) > 350}
    assert not long, long
