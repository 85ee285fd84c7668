"""Guided decoding on vLLM 0.6.0 - 0.6.4 as installed today: what outlines imports, supplied.

Catalogue entry: row ``guided_decoding_imports`` of ``vllm_bi100_patch.patching.table``
(docs/serving-compat.md, "Guided decoding").  vLLM 0.6.3 builds every guided request's logits
processor with outlines 0.0.43 - 0.0.46 (its default backend), and ``import outlines`` imports
``outlines.types.airports``, which does ``from pyairports.airports import AIRPORT_LIST``.
pyairports was delisted from PyPI in 2025 (vLLM issue #23983); the name now holds an
unrelated 0.0.1 upload without that module, so on a server installed today every guided
request fails with ``ModuleNotFoundError``.

Mechanism: a ``sys.meta_path`` finder, installed at activation, answers only for
``pyairports`` and ``pyairports.airports``, and only when no other finder finds them (a real
pyairports always wins), the installed outlines is a release whose code was checked (its
``types/airports.py`` has the checked shape and no other outlines module names pyairports)
and the installed vLLM is one that uses such an outlines.  It then serves ``pyairports`` (an
empty package) and ``pyairports.airports`` with ``AIRPORT_LIST = []``: outlines uses the list
only for its ``types.airports.IATA`` enum (an airport-code type of its Python API), which no
JSON schema, regex or choice that vLLM compiles refers to.

Activation layer: stdlib only; the checks run when ``pyairports`` is looked up, once.
"""

from __future__ import annotations

import _thread
import sys

from ..activation.log import log

TYPE_CHECKING = False  # imported at interpreter start when active: no typing, no logging
if TYPE_CHECKING:
    import importlib.machinery
    import types
    from typing import Any, Dict, List, Optional, Sequence

ROW = "guided_decoding_imports"
NAMES = ("pyairports", "pyairports.airports")
MARKER = "__vllm_bi100_substitute__"
#: outlines releases whose code was read: ``outlines/types/airports.py``'s syntax tree
#: (``ast.dump``, sha256, first 16 hex digits) as read in each.
OUTLINES_KNOWN: Dict[str, str] = {
    "0.0.46": "e6bd8b3eae3e8b01",
}
#: outlines' only reader of pyairports.
READER = "outlines/types/airports.py"
#: The vLLM releases whose guided decoding uses outlines 0.0.43 - 0.0.46 (0.6.5 moved to
#: outlines 0.1.11, which uses airportsdata instead).
VLLM_RANGE = ((0, 5, 0), (0, 6, 5))


class _Loader:
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        setattr(module, MARKER, True)
        if module.__name__ == "pyairports":
            module.__doc__ = ("vllm-bi100-patch's stand-in for the delisted pyairports (row "
                              f"{ROW}): only what outlines imports")
            module.__path__ = []  # type: ignore[attr-defined]
        else:
            module.__doc__ = ("vllm-bi100-patch's stand-in for pyairports.airports (row "
                              f"{ROW}): outlines reads AIRPORT_LIST only for its airport-code "
                              "type, which no JSON schema, regex or choice vLLM compiles uses")
            module.AIRPORT_LIST = []  # type: ignore[attr-defined]
        with _lock:
            _supplied.append(module.__name__)
        if module.__name__ == "pyairports.airports":
            log.warning("vllm-bi100-patch: pyairports.airports is not installed (PyPI's "
                        "pyairports is an unrelated upload since 2025, vLLM issue #23983): "
                        "supplied an empty AIRPORT_LIST so that outlines (guided decoding) "
                        "imports; what any JSON schema, regex or choice decodes to is "
                        "unchanged (row %s)", ROW)


class PyairportsFinder:
    """Answers for ``pyairports`` and ``pyairports.airports`` only, and only where nothing
    else provides them and the checks pass."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[types.ModuleType] = None
                  ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in NAMES or _busy.get(fullname):
            return None
        if _found_elsewhere(self, fullname, path):
            return None
        if why_not() is not None:
            return None
        import importlib.util

        return importlib.util.spec_from_loader(fullname, _Loader(),  # type: ignore[arg-type]
                                               origin="vllm_bi100_patch.serving.guided_imports",
                                               is_package=fullname == "pyairports")


def _found_elsewhere(me: PyairportsFinder, fullname: str, path: Any) -> bool:
    _busy[fullname] = True
    try:
        for finder in list(sys.meta_path):
            if finder is me:
                continue
            find = getattr(finder, "find_spec", None)
            if find is not None and find(fullname, path) is not None:
                return True
        return False
    finally:
        _busy.pop(fullname, None)


def why_not() -> Optional[str]:
    """None where the finder may answer (this vLLM uses a checked outlines release); else
    why not (checked once per process)."""
    with _lock:
        if "why" not in _checked:
            _checked["why"] = _check()
        return _checked["why"]


def _check() -> Optional[str]:
    import importlib.metadata as md

    from ..patching import versions

    info = versions.installed_vllm_version()
    release = tuple(info.release[:3]) if info.release is not None else None
    if release is None or not VLLM_RANGE[0] <= release < VLLM_RANGE[1]:
        return (f"vLLM {info.raw} does not use outlines 0.0.43 - 0.0.46 (only 0.5.0 - 0.6.4 "
                "do)")
    try:
        dist = md.distribution("outlines")
    except md.PackageNotFoundError:
        return "outlines is not installed"
    if dist.version not in OUTLINES_KNOWN:
        return (f"outlines {dist.version}: the row was checked against outlines "
                + ", ".join(OUTLINES_KNOWN) + " only")
    shape = reader_shape(str(dist.locate_file(READER)))
    if shape != OUTLINES_KNOWN[dist.version]:
        return (f"outlines {dist.version}'s {READER} has a code shape the row was not checked "
                f"against ({shape})")
    others = [str(f) for f in dist.files or () if str(f).endswith(".py") and str(f) != READER
              and "pyairports" in _read(str(dist.locate_file(f)))]
    if others:
        return f"outlines {dist.version} names pyairports outside {READER}: {others}"
    return None


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError):
        return ""


def reader_shape(path: str) -> str:
    """The code shape of outlines' ``types/airports.py`` at ``path`` (16 hex digits of its
    syntax tree, docstrings and formatting left out), or why it cannot be read."""
    import ast
    import hashlib

    from ..patching.source import parse

    source = _read(path)
    if not source:
        return f"{path} cannot be read"
    tree = parse(source)
    body = [n for n in tree.body if not (isinstance(n, ast.Expr)
                                         and isinstance(n.value, ast.Constant))]
    text = ast.dump(ast.Module(body=body, type_ignores=[]), include_attributes=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_lock = _thread.RLock()
_busy: Dict[str, bool] = {}
_checked: Dict[str, Optional[str]] = {}
_supplied: List[str] = []
_finder: Optional[PyairportsFinder] = None


def installed() -> bool:
    return _finder is not None and _finder in sys.meta_path


def install() -> None:
    """Put the finder on ``sys.meta_path`` (idempotent); it answers only when asked for a
    pyairports that nothing else provides."""
    global _finder
    with _lock:
        if _finder is None:
            _finder = PyairportsFinder()
        if _finder not in sys.meta_path:
            sys.meta_path.append(_finder)  # last: every real finder is asked first anyway


def uninstall() -> None:
    """The finder leaves ``sys.meta_path``; modules it served stay loaded (outlines holds
    them), and are named by ``state()``."""
    with _lock:
        if _finder is not None:
            while _finder in sys.meta_path:
                sys.meta_path.remove(_finder)


def is_substitute(module: Any) -> bool:
    return module is not None and getattr(module, MARKER, False) is True


def state() -> Dict[str, Any]:
    """What the row did in this process: whether the finder is on, what it served, and why
    it would not answer (None: it would)."""
    with _lock:
        return {"installed": installed(), "supplied": list(_supplied),
                "why_not": _checked.get("why") if "why" in _checked else "not asked yet"}
