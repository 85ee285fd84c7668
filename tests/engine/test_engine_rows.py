"""The engine rows ``tp_empty_logits``, ``stream_delta`` and ``mrope_positions`` on fake
modules of the code shapes they fix: applied only where that shape is (a known fingerprint),
"not needed" where vLLM has the fix, failing their code check on an unknown shape, plain
methods wrapped so they bind like one and reverted to the very same function.  vLLM's own
code drives them in test_killers.py (stand-in and real wheels)."""

from __future__ import annotations

import importlib
import inspect
import os
import types

import pytest
import torch

from vllm_bi100_patch.activation import config
from vllm_bi100_patch.patching import code_shapes, factories, registry, table
from vllm_bi100_patch.engine import logits_gather, mrope_positions, stream_delta
from vllm_bi100_patch.patching import patch_row

ON = config.load({config.MODE: "1"})

LOGITS = '''"""Fake logits processor: the layer's forward as CoreX 3.2.3 or stock vLLM has it."""
import torch


def _prune_hidden_states(hidden_states, sampling_metadata):
    return hidden_states.index_select(0, sampling_metadata.selected_token_indices)


def _apply_logits_processors(logits, sampling_metadata):
    for seq_group in sampling_metadata.seq_groups:
        pass
    return logits


class LogitsProcessor:

    def __init__(self, rank=0):
        self.rank = rank
        self.logits_as_input = False

    def forward(self, lm_head, hidden_states, sampling_metadata, embedding_bias=None):
        if self.logits_as_input:
            logits = hidden_states
        else:
            hidden_states = _prune_hidden_states(hidden_states, sampling_metadata)
{get}
        if logits is not None:
            logits = _apply_logits_processors(logits, sampling_metadata)
        return logits

    def _get_logits(self, hidden_states, lm_head, embedding_bias):
        return hidden_states @ lm_head.weight.t() if self.rank == 0 else None  # the gather
'''
LOGITS_GET = {
    "vendor": """            if hidden_states.shape[0] > 0:
                logits = self._get_logits(hidden_states, lm_head, embedding_bias)
            else:
                logits = torch.empty([0, lm_head.weight.shape[0]], dtype=hidden_states.dtype)""",
    "stock": """            logits = self._get_logits(hidden_states, lm_head, embedding_bias)""",
}

SEQUENCE = '''"""Fake sequence: the delta of output token ids as vLLM 0.6.2 (CoreX 3.2.3) or 0.6.3."""


class Sequence:

    def __init__(self, prompt):
        self.all_ids = list(prompt)
        self.output_len = 0
        self._last_output_token_ids_offset = 0

    def append(self, token):
        self.all_ids.append(token)
        self.output_len += 1

    def get_output_len(self):
        return self.output_len

    def get_output_token_ids_to_return(self, delta):
        if not delta:
            return self.all_ids[len(self.all_ids) - self.output_len:]
        output_len = self.get_output_len()
        num_new_tokens = output_len - self._last_output_token_ids_offset
        self._last_output_token_ids_offset = output_len
        if num_new_tokens == 1:
            return self.all_ids[-1]
{guard}
        return self.all_ids[-num_new_tokens:]
'''
SEQUENCE_GUARD = {"vendor": "", "stock": "        if num_new_tokens == 0:\n            return []\n"}

RUNNER = '''"""Fake model-input builder: the MRoPE positions of a prompt, before/after vLLM 0.6.5."""


class MRotaryEmbedding:

    @staticmethod
    def get_input_positions(tokens, context_len=0, seq_len=None):
        full = [[p + 100 * axis for p in range(len(tokens))] for axis in range(3)]
        return [axis[context_len:seq_len] for axis in full], -5


class ModelInputForGPUBuilder:

    def _compute_multi_modal_input(self, inter_data, seq_group_metadata):
        if not seq_group_metadata.multi_modal_data:
            return
        inter_data.mrope_input_positions = [None] * len(inter_data.seq_ids)
        for seq_idx, seq_id in enumerate(inter_data.seq_ids):
            seq_data = seq_group_metadata.seq_data[seq_id]
            positions, delta = MRotaryEmbedding.get_input_positions(
                seq_data.tokens, context_len=inter_data.context_lens[seq_idx]{end})
            seq_data.mrope_position_delta = delta
            inter_data.mrope_input_positions[seq_idx] = positions
'''
RUNNER_END = {"vendor": "", "stock": ", seq_len=inter_data.seq_lens[seq_idx]"}

FILES = {
    "logits": ("vllm/model_executor/layers/logits_processor.py", patch_row.LOGITS, "LogitsProcessor",
               "forward", logits_gather, "tp_empty_logits"),
    "sequence": ("vllm/sequence.py", patch_row.SEQUENCE, "Sequence", "get_output_token_ids_to_return",
                 stream_delta, "stream_delta"),
    "runner": ("vllm/worker/model_runner.py", patch_row.MODEL_RUNNER, "ModelInputForGPUBuilder",
               "_compute_multi_modal_input", mrope_positions, "mrope_positions"),
}


def _source(which: str, kind: str) -> str:
    if which == "logits":
        return LOGITS.replace("{get}", LOGITS_GET[kind])
    if which == "sequence":
        return SEQUENCE.replace("{guard}", SEQUENCE_GUARD[kind])
    return RUNNER.replace("{end}", RUNNER_END[kind])


@pytest.fixture
def fake(fake_vllm_factory, monkeypatch):
    """Import a fake module (``which``) of a build with the bug (``"vendor"``) or the fix
    (``"stock"``); a buggy fake's shape is made a known one (it is not vLLM's code)."""

    def load(which: str, kind: str = "vendor", known: bool = True,
             version: str = "0.6.3+corex.3.2.3"):
        root = fake_vllm_factory(version)
        path, name, owner, attr, row_module, _ = FILES[which]
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        package = os.path.join(root, "vllm")
        for part in os.path.relpath(os.path.dirname(full), package).split(os.sep):
            if part != ".":
                package = os.path.join(package, part)
                open(os.path.join(package, "__init__.py"), "a").close()
        with open(full, "w") as fh:
            fh.write(_source(which, kind))
        importlib.invalidate_caches()
        module = importlib.import_module(name)
        if known and kind == "vendor":
            shape = code_shapes.fingerprint(vars(vars(module)[owner])[attr])
            monkeypatch.setitem(row_module.KNOWN, shape, "fake")
        return module

    return load


@pytest.mark.parametrize("which", sorted(FILES))
def test_the_row_is_in_the_table(which):
    path, name, owner, attr, _, row_name = FILES[which]
    row = table.by_name(row_name)
    assert row.kind == patch_row.WRAP_INSTANCE and row.target == f"{name}:{owner}.{attr}"
    assert row_name in config.PATCH_NAMES and name in table.hooked_modules()
    assert f"`{row_name}` (instance method)" in table.catalogue()
    assert row.params.startswith("code:") and row.when is not None


@pytest.mark.parametrize("which", sorted(FILES))
def test_not_applied_where_vllm_has_the_fix(fake, which):
    _, _, owner, attr, _, row_name = FILES[which]
    mod = fake(which, "stock")
    original = vars(vars(mod)[owner])[attr]
    report = registry.apply_to(mod, ON)
    assert report.reason is None and report.applied == [], report
    assert report.skipped[row_name].startswith("not needed: "), report.skipped
    assert vars(vars(mod)[owner])[attr] is original


@pytest.mark.parametrize("which", sorted(FILES))
def test_an_unknown_shape_fails_its_code_check(fake, which):
    _, _, owner, attr, _, _ = FILES[which]
    mod = fake(which, "vendor", known=False)
    original = vars(vars(mod)[owner])[attr]
    report = registry.apply_to(mod, ON)
    assert report.applied == [] and report.reason is not None
    assert "code shape this fix was not checked against (fingerprint" in report.reason
    assert vars(vars(mod)[owner])[attr] is original


@pytest.mark.parametrize("which", sorted(FILES))
def test_disabled_by_name_and_absent_code_is_not_a_failure(fake, which):
    _, name, owner, attr, _, row_name = FILES[which]
    mod = fake(which, "vendor")
    original = vars(vars(mod)[owner])[attr]
    report = registry.apply_to(mod, config.load({config.MODE: "1", config.DISABLE: row_name}))
    assert report.skipped[row_name].startswith("disabled by") and report.applied == []
    assert vars(vars(mod)[owner])[attr] is original
    empty = registry.apply_to(types.ModuleType(name), ON)
    assert empty.reason is None and f"has no {owner}.{attr}" in empty.skipped[row_name]


def _applied(mod, owner, attr, row_name):
    cls = vars(mod)[owner]
    original = vars(cls)[attr]
    report = registry.apply_to(mod, ON)
    assert report.reason is None and report.applied == [row_name], report
    wrapped = vars(cls)[attr]
    assert type(wrapped) is registry.PatchWrapper
    assert inspect.signature(wrapped) == inspect.signature(original)
    return cls, original


def _metadata(selected, seq_groups):
    return types.SimpleNamespace(selected_token_indices=torch.tensor(selected, dtype=torch.long),
                                 seq_groups=seq_groups)


def test_tp_empty_logits_gives_ranks_above_0_what_stock_gives(fake):
    mod = fake("logits")
    head = types.SimpleNamespace(weight=torch.randn(7, 4))
    hidden = torch.randn(5, 4)
    rank1 = mod.LogitsProcessor(rank=1)
    with pytest.raises(TypeError, match="'NoneType' object is not iterable"):  # the vendor's
        rank1.forward(head, hidden, _metadata([], None))
    cls, original = _applied(mod, "LogitsProcessor", "forward", "tp_empty_logits")
    before = factories.call_counts()["tp_empty_logits"]
    assert rank1.forward(head, hidden, _metadata([], None)) is None  # nothing samples
    assert factories.call_counts()["tp_empty_logits"] == before + 1
    assert rank1.forward(head, hidden, _metadata([4], None)) is None  # the gather's None
    rank0 = mod.LogitsProcessor(rank=0)
    empty = rank0.forward(head, hidden, sampling_metadata=_metadata([], []))
    assert empty.shape == (0, 7)  # the driver keeps the vendor's empty tensor
    got = rank0.forward(head, hidden, _metadata([1, 4], []))
    assert torch.equal(got, hidden[[1, 4]] @ head.weight.t())
    assert factories.call_counts()["tp_empty_logits"] == before + 1
    assert registry.revert_all() == ["forward"]
    assert vars(cls)["forward"] is original


def test_stream_delta_returns_nothing_for_a_step_without_tokens(fake):
    mod = fake("sequence")
    seq = mod.Sequence([11, 12, 13])
    assert seq.get_output_token_ids_to_return(True) == [11, 12, 13]  # the vendor's bug
    cls, original = _applied(mod, "Sequence", "get_output_token_ids_to_return", "stream_delta")
    seq = mod.Sequence([11, 12, 13])
    assert seq.get_output_token_ids_to_return(True) == []  # a prefill chunk: no new token
    assert seq.get_output_token_ids_to_return(delta=True) == []
    seq.append(21)
    assert seq.get_output_token_ids_to_return(True) == 21  # one new token: the original's
    seq.append(22)
    seq.append(23)
    assert seq.get_output_token_ids_to_return(True) == [22, 23]
    assert seq.get_output_token_ids_to_return(False) == [21, 22, 23]
    assert seq.get_output_token_ids_to_return(True) == []
    assert registry.revert_all() == ["get_output_token_ids_to_return"]
    assert vars(cls)["get_output_token_ids_to_return"] is original


def _inter(tokens, context, seq_len, seq_id=3):
    return types.SimpleNamespace(seq_ids=[seq_id], context_lens=[context], seq_lens=[seq_len],
                                 input_tokens=[list(tokens[context:seq_len])],
                                 mrope_input_positions=None)


def _meta(tokens, mm=True, delta=None, seq_id=3):
    data = types.SimpleNamespace(tokens=tokens, mrope_position_delta=delta)
    return types.SimpleNamespace(multi_modal_data={"image": 1} if mm else None,
                                 seq_data={seq_id: data})


def test_mrope_positions_of_a_chunk_are_the_chunks(fake):
    mod = fake("runner")
    tokens = list(range(40))
    builder = mod.ModelInputForGPUBuilder()
    stock = _inter(tokens, 32, 36)
    builder._compute_multi_modal_input(stock, _meta(tokens))
    assert [len(a) for a in stock.mrope_input_positions[0]] == [8, 8, 8]  # the bug: 4 tokens
    cls, original = _applied(mod, "ModelInputForGPUBuilder", "_compute_multi_modal_input",
                             "mrope_positions")
    builder = mod.ModelInputForGPUBuilder()
    before = factories.call_counts()["mrope_positions"]
    chunk = _inter(tokens, 32, 36)
    builder._compute_multi_modal_input(chunk, _meta(tokens))
    assert chunk.mrope_input_positions[0] == [list(range(32 + 100 * a, 36 + 100 * a))
                                              for a in range(3)]
    last = _inter(tokens, 36, 40)  # the last chunk already has its tokens' positions
    builder._compute_multi_modal_input(last, _meta(tokens))
    assert [len(a) for a in last.mrope_input_positions[0]] == [4, 4, 4]
    assert factories.call_counts()["mrope_positions"] == before + 1
    assert registry.revert_all() == ["_compute_multi_modal_input"]
    assert vars(cls)["_compute_multi_modal_input"] is original


def test_mrope_positions_from_the_delta_follow_a_prefix_cache_hit(fake):
    """Positions made from the request's delta (``_compute_lens``) for [16, 32), then a
    prefix-cache hit kept only [24, 32): the kept suffix, checked against the delta."""
    mod = fake("runner")
    registry.apply_to(mod, ON)
    builder = mod.ModelInputForGPUBuilder()
    tokens = list(range(40))
    inter = _inter(tokens, 24, 32)
    inter.mrope_input_positions = [[list(range(16 - 5, 32 - 5))] * 3]
    builder._compute_multi_modal_input(inter, _meta(tokens, mm=False, delta=-5))
    assert inter.mrope_input_positions[0] == [list(range(24 - 5, 32 - 5))] * 3
    wrong = _inter(tokens, 24, 32)
    wrong.mrope_input_positions = [[list(range(16, 32))] * 3]  # not the delta's positions
    with pytest.raises(RuntimeError, match="not its request's delta positions"):
        builder._compute_multi_modal_input(wrong, _meta(tokens, mm=False, delta=-5))
