"""tools/account.py: the launch, byte and FLOP account the benchmark prints and the kernel
budget tests hold."""

from __future__ import annotations

import pytest
import torch

from tools.account import DEVICES, FREE_OPS, Account, HalfGemmsInFloat, predict


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


def test_in_place_matrix_products_count_their_flops():
    acc_t = torch.zeros(4, 8, 32)
    a, b = torch.randn(4, 8, 16), torch.randn(4, 16, 32)
    out2 = torch.zeros(8, 32)
    with Account() as acc:
        acc_t.baddbmm_(a, b)
        out2.addmm_(a[0], b[0])
    assert acc.by_op == {"baddbmm_": 1, "addmm_": 1}
    assert [launch.flops for launch in acc.log] == [2 * 4 * 8 * 16 * 32, 2 * 8 * 16 * 32]


def test_fused_attention_flops_cover_every_query_head():
    q = torch.randn(1, 8, 16, 64)
    k, v = torch.randn(1, 2, 32, 64), torch.randn(1, 2, 32, 64)
    with Account() as acc:
        torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1),
                                                         v.repeat_interleave(4, 1))
    fused = [launch for launch in acc.log if "scaled_dot_product" in launch.name]
    assert len(fused) == 1
    assert fused[0].flops == 2 * 2 * 8 * 16 * 32 * 64  # Q K^T and P V


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_gemms_in_float_leave_the_account_unchanged(dtype):
    """The fast CPU account: the same ops, bytes and FLOPs as the real half GEMMs, results
    rounded from float32 products."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 16, 32, generator=g).to(dtype)
    b = torch.randn(3, 32, 8, generator=g).to(dtype)
    acc32 = torch.zeros(3, 16, 8)

    def work():
        c = torch.bmm(a, b)
        d = torch.mm(a[0], b[0])
        e = torch.matmul(a, b).float()
        acc32.add_(e)
        return c, d

    with Account() as plain:
        c0, d0 = work()
    acc32.zero_()
    with HalfGemmsInFloat(), Account() as fast:
        c1, d1 = work()
    assert [(x.name, x.bytes, x.flops) for x in fast.log] == [
        (x.name, x.bytes, x.flops) for x in plain.log]
    assert c1.dtype == dtype and d1.dtype == dtype
    exact = torch.bmm(a.double(), b.double())
    tol = 1e-2 if dtype == torch.float16 else 8e-2
    assert (c1.double() - exact).abs().max() <= tol
    assert (c0.double() - exact).abs().max() <= tol


def test_half_gemms_in_float_in_place_and_out_variants():
    a = torch.randn(2, 4, 8).half()
    b = torch.randn(2, 8, 4).half()
    dest = torch.zeros(2, 4, 4).half()
    out = torch.empty(2, 4, 4).half()
    with HalfGemmsInFloat():
        r = dest.baddbmm_(a, b)
        torch.bmm(a, b, out=out)
    assert r is dest and dest.dtype == torch.float16
    expected = torch.bmm(a.float(), b.float())
    assert torch.allclose(dest.float(), expected, atol=1e-2)
    assert torch.allclose(out.float(), expected, atol=1e-2)


def test_free_ops_are_not_launches():
    assert "empty" in FREE_OPS and "view" in FREE_OPS and "add" not in FREE_OPS
