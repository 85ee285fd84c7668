"""The device checks (``vllm_bi100_patch.ops.selftest.checks``, the ones ``selftest`` runs) under
pytest, on ``BI100_TEST_DEVICE`` (default cpu, where the GPU formulation is forced):
``BI100_TEST_DEVICE=cuda python -m pytest tests/attention/kernels/test_device.py`` on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

from vllm_bi100_patch.ops.selftest import checks as device_checks

DEVICE = torch.device(os.environ.get("BI100_TEST_DEVICE", "cpu"))


@pytest.fixture(autouse=True)
def _device_formulation():
    with device_checks.device_formulation(DEVICE):
        yield


@pytest.mark.parametrize("check", device_checks.CHECKS, ids=lambda c: c.__name__)
def test_device_check(check):
    try:
        check(DEVICE)
    except device_checks.Skip as why:
        pytest.skip(str(why))


# The command an operator runs (``vllm-bi100-patch selftest``: the same checks, exit status,
# JSON) is tested in ``tests/ops/test_selftest.py``.
