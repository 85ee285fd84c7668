"""The pyairports stub wheel.

pyairports (needed by outlines 0.0.43-0.0.46, which vLLM 0.5.x-0.6.x import) only has a 2025
placeholder release 0.0.1 left on PyPI, without ``pyairports.airports``; vLLM 0.5.x imports
outlines at ``import vllm`` and fails. A local stub wheel providing
``pyairports.airports.AIRPORT_LIST`` replaces it (through the installer's overrides).
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path
from typing import Dict

PYAIRPORTS_STUB_VERSION = "0.0.1+vllmenv.stub"
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
    name, ver = "pyairports", PYAIRPORTS_STUB_VERSION
    dist_info = f"{name}-{ver}.dist-info"
    files: Dict[str, str] = {
        f"{name}/__init__.py": "",
        f"{name}/airports.py": _PYAIRPORTS_STUB,
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n"
                                 "Summary: stub written by vllm_env (real data no longer on PyPI)\n",
        f"{dist_info}/WHEEL": ("Wheel-Version: 1.0\nGenerator: vllm_env\n"
                               "Root-Is-Purelib: true\nTag: py3-none-any\n"),
    }
    record = [f"{path},{record_hash(text.encode())},{len(text.encode())}"
              for path, text in files.items()]
    record.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = "\n".join(record) + "\n"
    wheel = Path(dest) / f"{name}-{ver}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return str(wheel)
