"""Shared fixtures: fake vLLM trees (one per signature family) and an installed-shim venv."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from typing import Iterator

import pytest

from fakes.fake_vllm import write_fake_vllm
from helpers.shim import ROOT, TEST_DEPS_SITE, venv_site_packages
from vllm_bi100_patch.patching import report


def reset_shim_state() -> None:
    """Forget everything the shim did in this process: patches reverted, registry, bootstrap
    and import-guard state cleared, finders off sys.meta_path, counters zeroed, logger level
    back to inherited. Run before and after every test (autouse), so no test sees another's
    ``_installed``/``_originals``, warnings already given, or an armed bootstrap."""
    import logging

    from vllm_bi100_patch.activation import bootstrap
    from vllm_bi100_patch.attention import import_guard
    from vllm_bi100_patch.patching import registry, strict

    with bootstrap._lock:
        bootstrap.deactivate()
        with registry._lock:
            registry.revert_all()
            registry._originals.clear()
            registry._installed.clear()
            strict._warned.clear()
            registry._last_report = report.Report()
            registry._module_reports.clear()
        bootstrap._finder.hooks.clear()
        bootstrap._finder.before.clear()
        bootstrap.reset()
        import_guard.uninstall()
    if "vllm_bi100_patch.patching.factories" in sys.modules:
        sys.modules["vllm_bi100_patch.patching.factories"].reset_call_counts()
    if "vllm_bi100_patch.patching.counting.export" in sys.modules:
        sys.modules["vllm_bi100_patch.patching.counting.export"].stop()
        sys.modules["vllm_bi100_patch.patching.counting.export"].suppressed = False
    logging.getLogger("vllm.bi100_patch").setLevel(logging.NOTSET)


@pytest.fixture(autouse=True)
def _isolated_shim_state():
    reset_shim_state()
    yield
    reset_shim_state()


def _purge_vllm() -> None:
    for name in list(sys.modules):
        if name == "vllm" or name.startswith("vllm.") or name == "_fake_triton_log":
            del sys.modules[name]


@pytest.fixture
def fake_vllm_factory(tmp_path, monkeypatch):
    """Make a fake vLLM tree importable in this process; cleans sys.modules/sys.path after."""
    made = []

    def make(version: str, **options: object) -> str:
        root = str(tmp_path / f"fake-{version}-{len(made)}")
        write_fake_vllm(root, version, **options)  # type: ignore[arg-type]
        monkeypatch.syspath_prepend(root)
        importlib.invalidate_caches()
        _purge_vllm()
        made.append(root)
        return root

    yield make
    reset_shim_state()
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


