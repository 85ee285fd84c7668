"""Where test configuration lives: markers in pyproject.toml only, nox sessions in noxfile.py
only, and an empty test selection failing the run (pytest exits 5, nox fails on any non-zero
exit, .ci/run fails when nox does)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILTIN_MARKS = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings"}


def _python_files(*tops):
    for top in tops:
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [x for x in dirs if not x.startswith(".") and x != "__pycache__"]
            yield from (os.path.join(d, f) for f in files if f.endswith(".py"))


def _read(path):
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def _registered_markers():
    text = _read(os.path.join(ROOT, "pyproject.toml"))
    block = re.search(r"^markers = \[(.*?)^\]", text, re.M | re.S)
    assert block, "pyproject.toml [tool.pytest.ini_options] has no markers list"
    return set(re.findall(r'^\s*"(\w+):', block.group(1), re.M))


def test_markers_are_registered_in_pyproject_only():
    registered = _registered_markers()
    assert {"slow", "real_vllm", "corex", "serve"} <= registered
    used, elsewhere = set(), []
    for path in _python_files("tests"):
        text = _read(path)
        used |= set(re.findall(r"pytest\.mark\.(\w+)", text))
        if re.search(r"addinivalue_line\(\s*[\"']markers", text):
            elsewhere.append(os.path.relpath(path, ROOT))
    assert elsewhere == [], f"markers registered outside pyproject.toml: {elsewhere}"
    assert used - BUILTIN_MARKS <= registered, f"unregistered: {used - BUILTIN_MARKS - registered}"


def test_nox_sessions_are_defined_in_noxfile_only():
    others = []
    for path in _python_files("tests", "scripts", "vllm_bi100_patch"):
        for node in ast.walk(ast.parse(_read(path))):
            if isinstance(node, ast.Attribute) and node.attr == "session" and \
                    isinstance(node.value, ast.Name) and node.value.id == "nox":
                others.append(os.path.relpath(path, ROOT))
    assert others == []
    noxfile = _read(os.path.join(ROOT, "noxfile.py"))
    for name in ("lint", "unit", "demo", "matrix", "serve_cpu"):
        assert re.search(rf"^def {name}\(session", noxfile, re.M), name


def test_an_empty_selection_fails_the_run():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                           "-m", "no_test_has_this_marker", os.path.abspath(__file__)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    # nox fails a session on any non-zero exit unless told otherwise: nothing tells it so.
    assert "success_codes" not in _read(os.path.join(ROOT, "noxfile.py"))
    ci = _read(os.path.join(ROOT, ".ci", "run"))
    assert "set -euo pipefail" in ci and re.search(r"^[^#]*python3 -m nox\s*$", ci, re.M)


def test_corex_standin_never_writes_through_a_hard_link(tmp_path):
    """tests/harness/corex/standin.py edits installed vLLM files that uv hard-links to its cache: an
    in-place write would turn the cached official wheel (and every venv made from it) into the
    stand-in."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_standin_under_test", os.path.join(ROOT, "tests", "harness", "corex", "standin.py"))
    standin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standin)
    cached = tmp_path / "cache-METADATA"
    cached.write_text("Version: 0.6.3.post1\n")
    installed = tmp_path / "METADATA"
    os.link(cached, installed)
    standin._write(str(installed), "Version: 0.6.3+corex.3.2.3\n")
    assert installed.read_text() == "Version: 0.6.3+corex.3.2.3\n"
    assert cached.read_text() == "Version: 0.6.3.post1\n"
    assert os.stat(cached).st_nlink == 1
