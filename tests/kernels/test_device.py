"""The device checks (``device_checks.py``) under pytest, on ``BI100_TEST_DEVICE`` (default
cpu, where the GPU formulation is forced): ``BI100_TEST_DEVICE=cuda python -m pytest
tests/kernels/test_device.py`` on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import device_checks
import pytest
import torch

DEVICE = torch.device(os.environ.get("BI100_TEST_DEVICE", "cpu"))


@pytest.fixture(autouse=True)
def _device_formulation():
    saved = device_checks.use_device_formulation(DEVICE)
    yield
    device_checks.restore(saved)


@pytest.mark.parametrize("check", device_checks.CHECKS, ids=lambda c: c.__name__)
def test_device_check(check):
    try:
        check(DEVICE)
    except device_checks.Skip as why:
        pytest.skip(str(why))


def test_plain_runner_without_pytest():
    """The runner a bare GPU machine uses: exit status and summary line."""
    proc = subprocess.run([sys.executable, device_checks.__file__, "--device", "cpu"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "device checks on cpu: 7 passed, 0 failed, 1 skipped" in proc.stdout
