"""The house by role stays visible (docs/layout.md): six rooms under the package's face
(``__init__``, ``__main__``, ``_version``) -- ``activation``, ``patching``, ``attention`` (with
``native/`` and ``kernels/``), ``engine``, ``serving``, ``ops`` (with ``selftest/``) -- and the
arrows between them: activation never imports torch or vLLM; the kernels are a leaf (torch and
the package logger only, no vLLM parameter names); attention, engine and serving never import
each other; only ``ops`` and the face may import everything; nothing imports ``ops`` but the
face and the CLI; no module imports back into one that (directly or not) imports it.  Inside
the rooms: the native decoder never imports vLLM, its route table and decoder never import each
other, and the code checks parse source through one neutral module."""

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
    """(path, depth below vllm_bi100_patch/attention) of every kernels module, its packages'
    too."""
    for path in sorted(glob.glob(os.path.join(PKG, "attention", "kernels", "**", "*.py"), recursive=True)):
        yield path, os.path.relpath(path, os.path.join(PKG, "attention")).count(os.sep)


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
                                              "collections", "contextlib"), (path, name)
            elif level > depth:  # out of kernels/: the package logger only
                assert level == depth + 2 and name == "activation.log", (path, name)


def test_decode_and_prefill_stay_in_their_packages():
    """A walk through decode never enters prefill, nor the other way round, and the shared
    modules beside them use neither; nothing imports a kernels package's face from below."""
    for path, depth in _kernel_modules():
        here = os.path.relpath(path, os.path.join(PKG, "attention", "kernels")).split(os.sep)
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
    for leaf in ("ops/audit", "patching/counting/export", "patching/counting/metrics",
                 "patching/counting/counters", "patching/source", "activation/config",
                 "patching/table", "patching/versions", "patching/hardware"):
        for _level, name in _imports(os.path.join(PKG, leaf + ".py")):
            assert not name.endswith(("registry", "doctor")), (leaf, name)


def test_the_native_decoder_never_imports_vllm():
    for path in glob.glob(os.path.join(PKG, "attention", "native", "*.py")):
        for level, name in _imports(path):
            assert not (level == 0 and name.split(".")[0] == "vllm"), (path, name)


def test_route_table_and_decoder_never_import_each_other():
    """Not even for types: ``native.build`` hands the decoder its route table."""
    native = os.path.join(PKG, "attention", "native")
    for here, other in (("routes", "decoder"), ("decoder", "routes")):
        for level, name in _imports(os.path.join(native, here + ".py")):
            assert not (level == 1 and name.split(".")[0] == other), (here, name)
            assert not (level == 0 and name.startswith("vllm_bi100_patch.attention.native." + other))
            assert not (level == 2 and name.startswith("native." + other)), (here, name)


def test_code_checks_parse_source_through_the_neutral_module():
    for level, name in _imports(os.path.join(PKG, "patching", "source.py")):
        assert level == 0 and name.split(".")[0] in ("__future__", "ast", "inspect",
                                                     "textwrap", "threading", "typing"), name
    users = [os.path.join(PKG, "ops", "audit.py")] + [
        p for room in ("attention", "engine", "serving") for p in glob.glob(os.path.join(PKG, room, "*.py"))]
    for path in users:
        text = open(path, encoding="utf-8").read()
        assert "native import probe" not in text and "probe." not in text, path


ROOMS = ("activation", "patching", "attention", "engine", "serving", "ops")
FACE = ("vllm_bi100_patch", "vllm_bi100_patch.__main__", "vllm_bi100_patch._version")
#: What each room may import of the package (besides itself and ``_version``).
MAY_IMPORT = {
    "activation": {"patching"},  # the bootstrap reads the table, decides, runs the registry
    "patching": {"activation"},  # configuration and the logger
    "attention": {"activation", "patching"},
    "engine": {"activation", "patching"},
    "serving": {"activation", "patching"},
    "ops": set(ROOMS),
}


def _module_name(path):
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _modules():
    return {_module_name(p): p for p in glob.glob(os.path.join(PKG, "**", "*.py"), recursive=True)}


def _type_checking_lines(tree):
    """Line numbers inside ``if TYPE_CHECKING:`` blocks (annotations only, never run)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) \
                and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def _package_edges(name, path, modules, runtime_only=True):
    """The package modules ``name`` imports (at import time or in a function), resolved:
    ``from .x import y`` names ``x.y`` when that is a module, else ``x``."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    skip = _type_checking_lines(tree) if runtime_only else set()
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - (node.level - 1)]
                                + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                target = f"{base}.{alias.name}"
                out.add(target if target in modules else base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {t for t in out if t in modules and t != name}


def _room(name):
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else None


def test_the_package_has_its_six_rooms_and_the_face_only():
    top = {os.path.splitext(n)[0] for n in os.listdir(PKG) if not n.startswith((".", "__pycache__"))}
    assert top == {"__init__", "__main__", "_version", *ROOMS}, top
    for room in ROOMS:
        doc = ast.get_docstring(ast.parse(open(os.path.join(PKG, room, "__init__.py")).read()))
        assert doc and "May import" in doc and "Owns" in doc, room


def test_rooms_import_only_what_their_role_allows():
    modules = _modules()
    bad = []
    for name, path in sorted(modules.items()):
        room = _room(name)
        for target in sorted(_package_edges(name, path, modules)):
            other = _room(target)
            if room is None:  # the face and the CLI import everything
                continue
            if other is None:
                if target != "vllm_bi100_patch._version":
                    bad.append((name, target))
            elif other != room and other not in MAY_IMPORT[room]:
                bad.append((name, target))
    assert not bad, bad


def test_nothing_imports_ops_but_the_face_and_the_cli():
    modules = _modules()
    users = {name for name, path in modules.items() if _room(name) != "ops"
             and any(_room(t) == "ops" for t in _package_edges(name, path, modules, False))}
    assert users == {"vllm_bi100_patch", "vllm_bi100_patch.__main__"}, users


def test_activation_never_imports_torch_vllm_or_wrapt():
    for path in glob.glob(os.path.join(PKG, "activation", "*.py")):
        for level, name in _imports(path):
            assert not (level == 0 and name.split(".")[0] in ("torch", "vllm", "wrapt")), (path, name)


def test_attention_engine_and_serving_never_import_each_other():
    """Not even in a function, not even for types."""
    modules = _modules()
    for name, path in modules.items():
        room = _room(name)
        if room in ("attention", "engine", "serving"):
            others = {_room(t) for t in _package_edges(name, path, modules, False)}
            assert not others & ({"attention", "engine", "serving"} - {room}), (name, others)


def test_no_module_imports_back_into_one_that_imports_it():
    """The import graph of the package's modules (imports in functions included) has no
    cycle: no back-arrow between two modules, no circle through several."""
    modules = _modules()
    graph = {name: _package_edges(name, path, modules) for name, path in modules.items()}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_a_long_module_says_its_concept_is_one():
    """One concept per module, in the room named for its role: a module longer than 350 lines
    says in its docstring why it is one concept ("One concept: ...")."""
    long = []
    for path in glob.glob(os.path.join(PKG, "**", "*.py"), recursive=True):
        text = open(path, encoding="utf-8").read()
        if len(text.splitlines()) > 350:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "One concept:" not in doc:
                long.append(os.path.relpath(path, ROOT))
    assert not long, long
