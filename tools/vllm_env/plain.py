"""A venv of plain PyPI packages and no vLLM: the agent-framework clients of ``nox -s
frameworks`` (docs/testing.md).

``uv venv`` + ``uv pip install PACKAGES --exclude-newer DATE``: the date holds every dependency
the pins leave open to the releases of that day, so a fresh clone resolves what the last one
did.  The venv is reused while its stamp (packages, date) is the same; otherwise it is made
anew.  uv hard-links from its cache, so a venv made anew with a warm cache takes seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from ._util import log, run
from .installer import _uv, create_venv, python_of

STAMP = "vllm_env-plain.json"


def plain_venv(venv_dir: str, packages: Sequence[str], *, python: Optional[str] = None,
               exclude_newer: Optional[str] = None, timeout: float = 1800) -> str:
    """The python of a venv at ``venv_dir`` holding ``packages`` (requirement strings),
    resolved as of ``exclude_newer`` (a date or RFC 3339 time); ``python`` is the base
    interpreter of a new venv (default: this one)."""
    want = {"packages": list(packages), "exclude_newer": exclude_newer}
    stamp = Path(venv_dir) / STAMP
    try:
        if json.loads(stamp.read_text()) == want:
            log(f"reusing {venv_dir}: {' '.join(packages)}")
            return python_of(venv_dir)
    except (OSError, ValueError):
        pass
    if stamp.exists():
        stamp.unlink()  # until the new install has succeeded, nothing is reused
    python_exe = create_venv(venv_dir, python, clear=True)
    cmd = [_uv(), "pip", "install", "--python", python_exe, *packages]
    if exclude_newer:
        cmd += ["--exclude-newer", exclude_newer]
    run(cmd, f"install {list(packages)}", timeout=timeout)
    stamp.write_text(json.dumps(want))
    return python_exe
