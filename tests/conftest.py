"""Shared fixtures: fake vLLM trees (one per signature family), an installed-shim venv, and
subprocess helpers for the activation matrix."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from typing import Dict, Iterator, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from fakes.fake_vllm import write_fake_vllm  # noqa: E402

from vllm_bi100_patch import versions  # noqa: E402

#: One representative release per signature family.
FAMILY_VERSIONS = {fam.name: fam.first for fam in versions.FAMILIES}


def _purge_vllm() -> None:
    for name in list(sys.modules):
        if name == "vllm" or name.startswith("vllm.") or name == "_fake_triton_log":
            del sys.modules[name]


@pytest.fixture
def fake_vllm_factory(tmp_path, monkeypatch):
    """Make a fake vLLM tree importable in this process; cleans sys.modules/sys.path after."""
    made = []
    from vllm_bi100_patch import registry

    registry._warned.clear()

    def make(version: str, **options: object) -> str:
        root = str(tmp_path / f"fake-{version}-{len(made)}")
        write_fake_vllm(root, version, **options)  # type: ignore[arg-type]
        monkeypatch.syspath_prepend(root)
        importlib.invalidate_caches()
        _purge_vllm()
        made.append(root)
        return root

    yield make
    from vllm_bi100_patch import registry

    registry.revert_all()
    _purge_vllm()


@pytest.fixture
def paged_attn_module(fake_vllm_factory):
    """Import the fake paged_attn of a given version (without the shim's bootstrap)."""

    def load(version: str, **options: object):
        fake_vllm_factory(version, **options)
        return importlib.import_module("vllm.attention.ops.paged_attn")

    return load


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


@pytest.fixture(scope="session")
def shim_venv(tmp_path_factory) -> Iterator[str]:
    """A venv (with the system site-packages for torch/wrapt) with the shim installed from a
    freshly built wheel, so sitecustomize, the .pth line and the entry point are real."""
    base = tmp_path_factory.mktemp("shim-venv")
    wheel_dir = base / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheel_dir), ROOT], check=True, capture_output=True)
    wheel = next(wheel_dir.glob("vllm_bi100_patch-*.whl"))
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
                    "--no-index", "-q", str(wheel)], check=True, capture_output=True)
    # torch, wrapt and packaging come from the interpreter running the tests (a nox venv or
    # not): its site-packages is appended after the venv's own, as a .pth line.
    with open(os.path.join(venv_site_packages(python), "zz_test_deps.pth"), "w") as fh:
        fh.write(TEST_DEPS_SITE + "\n")
    yield python


TEST_DEPS_SITE = os.path.dirname(os.path.dirname(importlib.import_module("wrapt").__file__))


def venv_site_packages(python: str) -> str:
    return subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
