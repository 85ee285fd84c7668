"""tools/account.py: the launch, byte and FLOP account the benchmark prints and the kernel
budget tests hold."""

from __future__ import annotations

import pytest
import torch

from tools.account import DEVICES, Account, predict


def test_views_and_allocations_are_free():
    x = torch.randn(8, 16)
    with Account() as acc:
        y = x.view(16, 8).t().permute(1, 0).unsqueeze(0)[0, 2:]
        torch.empty(100)
        torch.empty_like(x)
    assert acc.launches == 0 and acc.bytes == 0 and y.shape == (14, 8)


def test_elementwise_counts_each_distinct_tensor_once():
    a, b = torch.randn(64, 32), torch.randn(64, 32)
    with Account() as acc:
        c = a + b           # reads a, b; writes c
        c.mul_(2)           # in place: c counted once
        c.copy_(a)          # reads a, writes c
    assert acc.launches == 3
    assert acc.by_op == {"add": 1, "mul_": 1, "copy_": 1}
    n = 64 * 32 * 4
    assert [launch.bytes for launch in acc.log] == [3 * n, n, 2 * n]


def test_broadcast_operands_count_their_real_elements():
    a = torch.randn(64, 32)
    row = torch.randn(1, 32)
    with Account() as acc:
        a + row.expand(64, 32)
    assert acc.bytes == (2 * 64 * 32 + 32) * 4


def test_index_select_reads_what_it_selects():
    table = torch.randn(1000, 64)
    ids = torch.tensor([3, 7, 900], dtype=torch.int64)
    with Account() as acc:
        table.index_select(0, ids)
    assert acc.launches == 1
    assert acc.bytes == 2 * 3 * 64 * 4 + 3 * 8  # read selected + written, plus the index


def test_index_copy_moves_what_it_stores():
    dest = torch.zeros(1000, 64)
    src = torch.randn(3, 64)
    with Account() as acc:
        dest.index_copy_(0, torch.tensor([1, 2, 3]), src)
    assert acc.bytes == 2 * src.numel() * 4 + 3 * 8


def test_matmul_flops_and_host_reads():
    a, b = torch.randn(4, 8, 16), torch.randn(4, 16, 32)
    with Account() as acc:
        c = torch.bmm(a, b)
        value = c.sum().item()
    assert acc.by_op == {"bmm": 1, "sum": 1}
    assert acc.log[0].flops == 2 * 4 * 8 * 16 * 32
    assert acc.host_reads == 1 and isinstance(value, float)


def test_predicted_time_is_bandwidth_flops_and_launches():
    a = torch.randn(1 << 20)
    with Account() as acc:
        a.mul(3)
    model = DEVICES["bi-v100"]
    expected = max(8 * 2**20 / model.bandwidth, 2**20 / model.flops) + model.launch_s
    assert predict(acc, model) == pytest.approx(expected)
