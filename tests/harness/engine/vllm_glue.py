"""The pieces of vLLM's V0 worker that ``driver.Engine`` stands in for, per release.

A minimal model runner with only what ``ModelInputForGPUBuilder`` and the metadata builder
read, a CPU ``reshape_and_cache`` for official CUDA wheels on a CPU torch, the calls whose
form differs between releases (``XFormersImpl.forward``, the prompt inputs), the CPU stand-in
of xformers, and which attention path a forward call took (from the shim's counters).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))  # tests/: the fake xformers tree


def _fake_xformers() -> None:
    """vLLM's XFormers backend imports ``xformers``, which has no CPU build: put the tests'
    CPU stand-in first on sys.path when the real one is not importable."""
    import importlib.util

    if importlib.util.find_spec("xformers") is None:
        sys.path.insert(0, os.path.join(TESTS, "fakes", "fake_xformers"))


class Runner:
    """What ``ModelInputForGPUBuilder`` and the metadata builder read of a model runner."""

    def __init__(self, scheduler_config, block_size: int, num_blocks: int,
                 max_len: int) -> None:
        import numpy as np
        import torch
        from vllm.attention.backends.xformers import XFormersBackend
        from vllm.worker.model_runner import ModelInputForGPU

        self.scheduler_config = scheduler_config
        self.block_size = block_size
        self.attn_backend = XFormersBackend
        self._model_input_cls = ModelInputForGPU
        self.inter_data_cache: dict = {}
        self.sliding_window = None
        self.lora_config = None
        self.prompt_adapter_config = None
        self.multi_modal_input_mapper = None
        self.model_is_mrope = False
        self.device = torch.device("cpu")
        self.pin_memory = False
        self.max_seq_len_to_capture = max_len
        self.max_batchsize_to_capture = 0
        self.graph_block_tables = np.zeros((1, num_blocks), dtype=np.int32)
        self.model_config = _ModelConfig()

    def get_max_block_per_batch(self) -> int:
        return self.graph_block_tables.shape[1]


class _ModelConfig:
    is_encoder_decoder_model = False
    is_encoder_decoder = False
    enforce_eager = True
    hf_config = None
    uses_mrope = False


def _reshape_and_cache_cpu():
    """A test-side ``reshape_and_cache`` for official CUDA wheels on a CPU torch (their native
    op is missing); the vendor stand-in brings its own (fake ixformer)."""
    import torch

    def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *args, **kwargs):
        x = key_cache.shape[4]
        for t, slot in enumerate(slot_mapping.tolist()):
            if slot < 0:
                continue
            blk, off = divmod(slot, key_cache.shape[3])
            key_cache[blk, :, :, off, :] = key[t].reshape(key.shape[1], -1, x)
            value_cache[blk, :, :, off] = value[t]

    return torch, reshape_and_cache


def seq_table(scheduler, seq_id):
    for group in scheduler.running:
        for seq in group.seqs:
            if seq.seq_id == seq_id:
                return scheduler.block_manager.get_block_table(seq)
    return []


def _swap(src, dst, pairs) -> None:
    import torch

    s = torch.tensor([a for a, _ in pairs])
    d = torch.tensor([b for _, b in pairs])
    dst.index_copy_(1, d, src.index_select(1, s))


def _inputs(tokens):
    try:
        from vllm.inputs import token_inputs
    except ImportError:
        return {"prompt_token_ids": tokens}
    return token_inputs(tokens)


def _logprob():
    from vllm.sequence import Logprob

    return Logprob(0.0)


class _Layer:
    """The attention layer's scales, which ``XFormersImpl.forward`` reads from 0.7 on."""
    _k_scale = 1.0
    _v_scale = 1.0


def _forward(impl, q, k, v, kv_cache, md):
    """``XFormersImpl.forward`` as each release takes it: ``(layer, q, k, v, ...)`` from 0.7,
    ``(q, k, v, kv_cache, attn_metadata, k_scale, v_scale)`` before."""
    import inspect

    params = list(inspect.signature(impl.forward).parameters)
    if params[0] == "layer":
        return impl.forward(_Layer(), q, k, v, kv_cache, md)
    return impl.forward(q, k, v, kv_cache, md, **{p: 1.0 for p in ("k_scale", "v_scale")
                                                   if p in params})


_PATH_COUNTERS = ("forward_prefix", "dense_prefill")


def _path_counts():
    import vllm_bi100_patch

    counts = vllm_bi100_patch.status()["counts"]
    return [counts.get(k, 0) for k in _PATH_COUNTERS]


def _prompt_path(before, after) -> str:
    """Which kernel computed this step's prompt rows (one forward call takes one path for all
    of them): ``prefix`` (the shim's ``forward_prefix``: chunks with context in the batch),
    ``prompt:shim`` (row ``dense_prefill``'s kernel) or ``prompt:backend`` (the backend's own
    prompt kernel: the vendor's FwOp, or xformers)."""
    grew = [name for name, b, a in zip(_PATH_COUNTERS, before, after) if a > b]
    if "forward_prefix" in grew:
        return "prefix"
    return "prompt:shim" if "dense_prefill" in grew else "prompt:backend"


def _native_cache_write(block: int, kv_heads: int, head_size: int) -> bool:
    """Whether this build's ``ops.reshape_and_cache`` runs here (a one-token trial write)."""
    import torch
    import vllm._custom_ops as ops
    from vllm.attention.ops.paged_attn import PagedAttention

    kv = torch.zeros(PagedAttention.get_kv_cache_shape(1, block, kv_heads, head_size))
    kc, vc = PagedAttention.split_kv_cache(kv, kv_heads, head_size)
    k = torch.ones(1, kv_heads, head_size)
    try:
        ops.reshape_and_cache(k, k, kc, vc, torch.tensor([3]), "auto", 1.0, 1.0)
    except Exception:  # the official CUDA wheel on a CPU torch: no native op
        return False
    return bool(vc[0, :, :, 3].eq(1).all())
