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


def test_kernels_import_only_torch_and_the_logger():
    for path in glob.glob(os.path.join(PKG, "kernels", "*.py")):
        for level, name in _imports(path):
            if level == 0:
                assert name.split(".")[0] in ("torch", "math", "typing", "dataclasses",
                                              "__future__", "functools", "os",
                                              "collections"), (path, name)
            elif level >= 2:
                assert name == "_log", (path, name)


def test_kernels_know_no_vllm_parameter_names():
    for path in glob.glob(os.path.join(PKG, "kernels", "*.py")):
        text = open(path, encoding="utf-8").read()
        for word in VLLM_NAMES:
            assert word not in text, (os.path.relpath(path, ROOT), word)


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
                                                     "textwrap", "typing"), name
    users = [os.path.join(PKG, "ops_audit.py")] + glob.glob(os.path.join(PKG, "patches", "*.py"))
    for path in users:
        text = open(path, encoding="utf-8").read()
        assert "native import probe" not in text and "probe." not in text, path
