"""The device checks (``device_checks.py``) under pytest, on ``BI100_TEST_DEVICE`` (default
cpu, where the GPU formulation is forced): ``BI100_TEST_DEVICE=cuda python -m pytest
tests/kernels/test_device.py`` on a GPU."""

from __future__ import annotations

import os

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


# The plain runner a bare GPU machine uses (``python device_checks.py``: exit status and
# summary line) is run by ``test_bench_script.py::test_gpu_kernels_check_dry_run``.
