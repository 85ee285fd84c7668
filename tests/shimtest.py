"""Helpers shared by the test modules (imported by name: conftest.py files are not modules
to import from, and there are several of them)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from typing import Dict, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from fakes.fake_vllm import write_fake_vllm  # noqa: E402,F401

from vllm_bi100_patch import versions  # noqa: E402

#: One representative release per signature family.
FAMILY_VERSIONS = {fam.name: fam.first for fam in versions.FAMILIES}

# --------------------------------------------------------------------------------------------
# Subprocess helpers: every activation-order test runs in a fresh interpreter.

SUBPROCESS_PRELUDE = textwrap.dedent("""
    import json, sys
    def report(**kw):
        sys.stdout.write("@@REPORT@@" + json.dumps(kw, default=str) + "\\n")
        sys.stdout.flush()
    def patched():
        import vllm_bi100_patch.registry as r
        from vllm.attention.ops.paged_attn import PagedAttention
        return {n: r.is_ours(vars(PagedAttention)[n]) for n in ("forward_decode", "forward_prefix")}
    def prefix_state():
        m = sys.modules.get("vllm.attention.ops.prefix_prefill")
        if m is None:
            return "absent"
        return "substitute" if getattr(m, "__vllm_bi100_substitute__", False) else "real"
""")


def run_python(code: str, *, env: Optional[Dict[str, str]] = None, python: str = sys.executable,
               args: tuple = (), cwd: Optional[str] = None, timeout: int = 120,
               prelude: bool = True, script: bool = False) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("VLLM_BI100", "PYTHONPATH"))}
    full_env.update(env or {})
    source = (SUBPROCESS_PRELUDE if prelude else "") + textwrap.dedent(code)
    if script:  # multiprocessing's spawn needs a real __main__ file
        fd, path = tempfile.mkstemp(suffix=".py", prefix="bi100_probe_")
        with os.fdopen(fd, "w") as fh:
            fh.write(source)
        command = [python, *args, path]
    else:
        command = [python, *args, "-c", source]
    try:
        return subprocess.run(command, env=full_env, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)
    finally:
        if script:
            os.remove(path)


def reports(proc: subprocess.CompletedProcess) -> list:
    out = [json.loads(line[len("@@REPORT@@"):]) for line in proc.stdout.splitlines()
           if line.startswith("@@REPORT@@")]
    if proc.returncode != 0 or not out:
        raise AssertionError(f"subprocess failed (rc={proc.returncode})\nstdout:\n{proc.stdout}"
                             f"\nstderr:\n{proc.stderr}")
    return out


TEST_DEPS_SITE = os.path.dirname(os.path.dirname(importlib.import_module("wrapt").__file__))


def venv_site_packages(python: str) -> str:
    return subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
