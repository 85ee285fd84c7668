"""The pyairports wheels the installer puts in place of PyPI's ``pyairports``.

pyairports (needed by outlines 0.0.43-0.0.46, which vLLM 0.5.x-0.6.4 use) was delisted from
PyPI in 2025 (vLLM issue #23983); the name now holds an unrelated 0.0.1 upload without
``pyairports.airports`` (a packaging template: top-level ``sample`` and ``tests`` packages,
a ``byted-wandb`` console script).  Two local wheels stand in for it (through the installer's
overrides), never the upload itself (code from an unknown uploader):

* ``build_pyairports_stub``: provides ``pyairports.airports.AIRPORT_LIST``, for vLLM 0.5.x,
  which imports outlines at ``import vllm`` and could not even start stock without it;
* ``build_pyairports_impostor``: the 0.0.1 upload's shape without its code (a ``pyairports``
  distribution whose only package is an inert ``sample``, no ``pyairports`` module), for
  vLLM 0.6.0-0.6.4: what a server installing vLLM 0.6.3 today gets, so that the sessions see
  guided decoding as a server does (stock: outlines cannot import; the shim's row
  ``guided_decoding_imports`` supplies what outlines needs).
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path
from typing import Dict

PYAIRPORTS_STUB_VERSION = "0.0.1+vllmenv.stub"
PYAIRPORTS_IMPOSTOR_VERSION = "0.0.1+vllmenv.impostor"
_IMPOSTOR_MAIN = ('"""The shape of PyPI\'s pyairports 0.0.1 (its sample.main), written by '
                  'tools/vllm_env: inert."""\n')
_PYAIRPORTS_STUB = (
    '"""Stub of pyairports written by tools/vllm_env: outlines only needs the name."""\n'
    'AIRPORT_LIST = [("Stub Airport", "Stub", "Stub", "XXX", "", "", "", "", "", "", "", "")]\n'
)


def record_hash(data: bytes) -> str:
    """A RECORD file's hash field (PEP 376/427): ``sha256=<urlsafe base64, no padding>``."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def build_pyairports_stub(dest: Path) -> str:
    """Write the pyairports stub wheel into the directory ``dest``; return its path."""
    return _wheel(dest, PYAIRPORTS_STUB_VERSION, {
        "pyairports/__init__.py": "",
        "pyairports/airports.py": _PYAIRPORTS_STUB,
    }, "stub written by vllm_env (real data no longer on PyPI)")


def build_pyairports_impostor(dest: Path) -> str:
    """Write a wheel of the shape of PyPI's pyairports 0.0.1 (no ``pyairports`` module, a
    top-level ``sample`` package) into ``dest``; return its path."""
    return _wheel(dest, PYAIRPORTS_IMPOSTOR_VERSION, {
        "sample/__init__.py": "",
        "sample/main.py": _IMPOSTOR_MAIN,
    }, "the shape of PyPI's pyairports 0.0.1 upload (no pyairports.airports), by vllm_env",
        top_level="sample\n")


def _wheel(dest: Path, ver: str, modules: Dict[str, str], summary: str,
           top_level: str = "") -> str:
    name = "pyairports"
    dist_info = f"{name}-{ver}.dist-info"
    files: Dict[str, str] = dict(modules)
    files.update({
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n"
                                 f"Summary: {summary}\n",
        f"{dist_info}/WHEEL": ("Wheel-Version: 1.0\nGenerator: vllm_env\n"
                               "Root-Is-Purelib: true\nTag: py3-none-any\n"),
    })
    if top_level:
        files[f"{dist_info}/top_level.txt"] = top_level
    record = [f"{path},{record_hash(text.encode())},{len(text.encode())}"
              for path, text in files.items()]
    record.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = "\n".join(record) + "\n"
    wheel = Path(dest) / f"{name}-{ver}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return str(wheel)
