"""The ``max_seq_len`` check (``native/longest.py``) is the guard between a lying ``max_seq_len``
and native V1 (which sizes its shared memory from it: on a card, a longer sequence hangs it).
It must hold under threads (no torn read of another call's longest sequence: a spurious
ValueError, or a lie accepted) and when ``seq_lens`` was written without a version bump
(``t.numpy()[:] = ...``): issue 21, item 8."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from helpers.reference import make_cache, make_tables

from helpers import native_decode

from vllm_bi100_patch.attention.native import decoder as dispatch
from vllm_bi100_patch.attention.native import longest
from vllm_bi100_patch.attention.native.routes import Routing


class RecordingOps:
    """A stock V1 only (as the vendor build has) that records the ``max_seq_len`` it was
    given: where a lie would reach it."""

    def __init__(self):
        self.given = []

    def paged_attention_v1(self, out, query, key_cache, value_cache, num_kv_heads, scale,
                           block_tables, seq_lens, block_size, max_seq_len, *rest):
        self.given.append(max_seq_len)
        out.fill_(1.0)


class Interleaved(torch.Tensor):
    """A ``seq_lens`` whose version read runs ``hook`` first: another thread's decode landing
    exactly between two reads of this call (what a thread switch there does)."""

    hook = None

    @property
    def _version(self):  # type: ignore[override]
        hook, Interleaved.hook = Interleaved.hook, None
        if hook is not None:
            hook()
        return super()._version


@pytest.fixture(autouse=True)
def _clean():
    dispatch.reset_route_counts()
    longest.forget()
    native_decode.forget()
    yield
    Interleaved.hook = None
    longest.forget()
    native_decode.forget()


def _batch(lens, device="cpu"):
    g = torch.Generator().manual_seed(0)
    kc, vc = make_cache(4, 2, 64, 16, torch.float32, gen=g)
    bt = make_tables([16] * len(lens), 16, 1, kc.shape[0], g)
    q = torch.randn(len(lens), 4, 64, generator=g)
    sl = torch.tensor(lens, dtype=torch.int32)
    return [t.to(device) for t in (q, kc, vc, bt)] + [sl.to(device)]


def _decode(batch, max_seq_len, ops, seq_lens=None, routing=None):
    q, kc, vc, bt, sl = batch
    return native_decode.decode(q, kc, vc, bt, sl if seq_lens is None else seq_lens,
                                max_seq_len, "auto", 2, 0.125, None, ops=ops,
                                routing=routing or Routing())


def test_a_write_without_a_version_bump_is_seen():
    ops = RecordingOps()
    batch = _batch([10, 20])
    _decode(batch, 20, ops)
    sl = batch[4]
    version = sl._version
    sl.numpy()[:] = [10, 40000]  # numpy writes through: the tensor's version stays
    assert sl._version == version
    with pytest.raises(ValueError, match=r"max_seq_len=20 is below the longest sequence in "
                                         r"seq_lens \(40000\)"):
        _decode(batch, 20, ops)
    assert ops.given == [20]  # the lie never reached V1


def test_another_call_between_two_reads_gives_no_spurious_error():
    ops = RecordingOps()
    batch = _batch([50, 100])
    mine = batch[4].as_subclass(Interleaved)
    _decode(batch, 100, ops, seq_lens=mine)
    other = _batch([3000, 5000])
    Interleaved.hook = lambda: _decode(other, 5000, RecordingOps())
    _decode(batch, 100, ops, seq_lens=mine)  # this call's longest is 100: valid
    assert ops.given == [100, 100]


def test_another_call_between_two_reads_lets_no_lie_through():
    ops = RecordingOps()
    batch = _batch([10, 6000])
    mine = batch[4].as_subclass(Interleaved)
    _decode(batch, 6000, ops, seq_lens=mine)
    honest = _batch([10, 100])
    Interleaved.hook = lambda: _decode(honest, 100, RecordingOps())
    with pytest.raises(ValueError, match=r"max_seq_len=100 is below the longest sequence in "
                                         r"seq_lens \(6000\)"):
        _decode(batch, 100, ops, seq_lens=mine)
    assert ops.given == [6000]


def test_device_reads_are_never_mixed_between_calls(monkeypatch):
    """A device ``seq_lens`` is read once per tensor version (``fallback_above``); another
    call's read landing between two reads of this call's must not answer for it."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    truth = {}
    monkeypatch.setattr(longest, "_read_longest", lambda t: truth[id(t)])
    routing = Routing(fallback_above=50)
    batch = _batch([50, 100], device="meta")
    mine = batch[4].as_subclass(Interleaved)
    truth[id(mine)] = 100
    ops = RecordingOps()
    _decode(batch, 100, ops, seq_lens=mine, routing=routing)  # read once: 100 > 50, fallback
    other = _batch([3000, 5000], device="meta")
    truth[id(other[4])] = 5000
    Interleaved.hook = lambda: _decode(other, 5000, ops, routing=routing)
    _decode(batch, 100, ops, seq_lens=mine, routing=routing)  # 100 is a valid bound
    assert dispatch.route_counts()["fallback"] == 3 and ops.given == []


def test_threads_get_their_own_answers():
    """Many threads, each with its own ``seq_lens``, half of them lying: every lie refused,
    no honest call refused, whatever the thread switches."""
    errors, wrong = [], []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)

    def work(i):
        ops = RecordingOps()
        honest, lying = _batch([10, 100 + i]), _batch([10, 6000 + i])
        for _ in range(150):
            try:
                _decode(honest, 100 + i, ops)
            except ValueError as exc:
                wrong.append(f"honest call refused: {exc}")
            try:
                _decode(lying, 100 + i, ops)
                wrong.append("lie accepted")
            except ValueError:
                pass
        if any(m != 100 + i for m in ops.given):
            wrong.append(f"V1 given {set(ops.given)}")

    def run(i):
        try:
            work(i)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == [] and wrong == [], (errors, wrong[:5], len(wrong))
