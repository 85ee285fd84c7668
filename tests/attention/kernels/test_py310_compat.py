"""The package keeps to Python 3.10 (the CoreX 3.2.3 stack): grammar and stdlib names.

``ast.parse(..., feature_version=(3, 10))`` rejects newer grammar (``except*``, PEP 695
type parameters, ...); the denylist catches stdlib names added in 3.11+ that the grammar
check cannot see.
"""

from __future__ import annotations

import ast
import glob
import os
from typing import List

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

#: ``module.name`` added after Python 3.10 (a deliberate, small list of the likely ones).
NEWER_THAN_310 = {
    "tomllib", "typing.Self", "typing.LiteralString", "typing.Never", "typing.assert_never",
    "typing.assert_type", "typing.reveal_type", "typing.Required", "typing.NotRequired",
    "typing.TypeVarTuple", "typing.Unpack", "typing.dataclass_transform", "typing.override",
    "typing.TypeAliasType", "enum.StrEnum", "enum.ReprEnum", "enum.verify", "enum.member",
    "enum.nonmember", "enum.global_enum", "datetime.UTC", "asyncio.TaskGroup",
    "asyncio.timeout", "contextlib.chdir", "hashlib.file_digest", "itertools.batched",
    "math.cbrt", "math.exp2", "operator.call", "builtins.ExceptionGroup",
    "builtins.BaseExceptionGroup", "ExceptionGroup", "BaseExceptionGroup",
}


def newer_names(source: str, filename: str = "<src>") -> List[str]:
    """Syntax errors under 3.10 grammar, and uses of ``NEWER_THAN_310`` names."""
    try:
        tree = ast.parse(source, filename, feature_version=(3, 10))
    except SyntaxError as exc:
        return [f"{filename}:{exc.lineno}: not Python 3.10 grammar: {exc.msg}"]
    found = []
    for node in ast.walk(tree):
        names: List[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names = [f"{node.value.id}.{node.attr}"]
        elif isinstance(node, ast.Name):
            names = [node.id]
        found += [f"{filename}:{node.lineno}: {n} is newer than Python 3.10"
                  for n in names if n in NEWER_THAN_310]
    return found


def package_files() -> List[str]:
    files = glob.glob(os.path.join(ROOT, "vllm_bi100_patch", "**", "*.py"), recursive=True)
    files.append(os.path.join(ROOT, "sitecustomize.py"))
    return sorted(f for f in files if os.path.exists(f))


def test_package_is_python_310_code():
    files = package_files()
    assert len(files) > 10
    problems = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            problems += newer_names(f.read(), os.path.relpath(path, ROOT))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("snippet", [
    "try:\n    pass\nexcept* ValueError:\n    pass\n",
    "import tomllib\n",
    "from typing import Self\n",
    "import enum\nclass A(enum.StrEnum):\n    pass\n",
    "import datetime\nnow = datetime.datetime.now(datetime.UTC)\n",
    "def f[T](x: T) -> T:\n    return x\n",
    "raise ExceptionGroup('x', [])\n",
])
def test_checker_flags_newer_code(snippet):
    assert newer_names(snippet)


def test_checker_accepts_310_code():
    assert not newer_names("from typing import Optional\nmatch 1:\n    case 1:\n        pass\n")
