"""``kernels.forced``: the one switch of the kernels' formulation (compute mode, tile layout,
prompt path): nests, restores what it found (an exception included), rejects unknown values,
and reaches kernel calls made from other threads while open."""

from __future__ import annotations

import threading

import pytest
import torch

from vllm_bi100_patch.attention.kernels.compute import compute_mode, fast_layout
from vllm_bi100_patch.attention.kernels.forced import Forcing, forced, forcing

CPU = torch.device("cpu")


def test_nested_blocks_restore_what_they_found_even_on_errors():
    assert forcing() == Forcing()
    with forced(compute="native", layout="generic") as outer:
        assert outer == forcing() == Forcing("native", "generic", None)
        with pytest.raises(RuntimeError):
            with forced(path="tiled", layout=None):
                assert forcing() == Forcing("native", None, "tiled")
                assert fast_layout(CPU)  # None: chosen by device again
                raise RuntimeError("inside")
        assert forcing() == outer
        assert compute_mode(CPU) == "native" and not fast_layout(CPU)
    assert forcing() == Forcing()
    assert compute_mode(CPU) == "fp32" and fast_layout(CPU)


def test_an_unknown_value_is_refused_and_changes_nothing():
    with pytest.raises(ValueError, match="compute='fp16'"):
        with forced(compute="fp16"):
            pass  # pragma: no cover
    assert forcing() == Forcing()


def test_other_threads_see_the_open_block():
    """vLLM's executor threads run the kernels: a block forces their calls too."""
    seen = []
    with forced(compute="native"):
        worker = threading.Thread(target=lambda: seen.append(compute_mode(CPU)))
        worker.start()
        worker.join()
    assert seen == ["native"]


def test_the_fixture_enters_each_block_for_the_test(force):
    force(compute="native")
    force(path="sdpa")
    assert forcing() == Forcing("native", None, "sdpa")
