"""Shim-level helpers: activation-order tests run code in fresh interpreters (``run_python``),
one representative release per signature family, the test venv's site-packages."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
import textwrap
from typing import Dict, Optional

from helpers.probes import PRELUDE, clean_env

from vllm_bi100_patch.patching import versions

#: The repository root.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: One representative release per signature family.
FAMILY_VERSIONS = {fam.name: fam.first for fam in versions.FAMILIES}


def run_python(code: str, *, env: Optional[Dict[str, str]] = None, python: str = sys.executable,
               args: tuple = (), cwd: Optional[str] = None, timeout: int = 120,
               prelude: bool = True, script: bool = False) -> subprocess.CompletedProcess:
    """Run ``code`` (after ``probes.PRELUDE`` unless ``prelude=False``) in a fresh interpreter
    with a clean environment plus ``env``; ``script=True`` runs it from a file."""
    source = (PRELUDE if prelude else "") + textwrap.dedent(code)
    if script:  # multiprocessing's spawn needs a real __main__ file
        fd, path = tempfile.mkstemp(suffix=".py", prefix="bi100_probe_")
        with os.fdopen(fd, "w") as fh:
            fh.write(source)
        command = [python, *args, path]
    else:
        command = [python, *args, "-c", source]
    try:
        return subprocess.run(command, env=clean_env(env), cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)
    finally:
        if script:
            os.remove(path)


TEST_DEPS_SITE = os.path.dirname(os.path.dirname(importlib.import_module("wrapt").__file__))


def venv_site_packages(python: str) -> str:
    return subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
