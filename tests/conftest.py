"""Shared fixtures: fake vLLM trees (one per signature family) and an installed-shim venv."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from typing import Iterator

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from shimtest import ROOT, TEST_DEPS_SITE, venv_site_packages, write_fake_vllm  # noqa: E402

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


