"""vLLM's own engine code builds the attention metadata that reaches the patched methods.

Runs inside a fresh interpreter of a venv with a real vLLM (0.6.x/0.7.x, V0 engine) and the
installed shim: ``python driver.py [--head-size N] [--layers N] [--dtype D] [--compute MODE]
SCENARIO [SCENARIO ...]`` prints one report line per scenario (``helpers.probes.report``).
Per engine step it does what ``LLMEngine.step`` and the GPU worker do, with vLLM's own code
wherever metadata is made:

- ``vllm.core.scheduler.Scheduler`` (block manager v2 with prefix caching, chunked prefill,
  preemption by recompute or swap) schedules the requests;
- the blocks it asks to swap or copy are moved in a CPU-side cache pair (the cache engine's
  job; test-side ``index_copy_``, or the shim's ``swap_blocks`` where it patched it);
- the real ``vllm.worker.model_runner.ModelInputForGPUBuilder`` (a minimal runner object with
  only what it reads) with the XFormers backend's metadata builder makes the model input;
- ``XFormersImpl.forward`` (per attention layer, each with its own paged cache, one metadata
  object for all, no weights) writes the new tokens into the paged cache and runs the prompt
  attention (``_run_memory_efficient_xformers_forward``) or calls the patched
  ``PagedAttention.forward_prefix`` / ``forward_decode``;
- every output row is compared with ``helpers.reference.attend`` (float64, dense) over the
  sequence's true tokens, and every prompt row is kept by (request, layer, position) with the
  path that computed it (``same_prompt.py`` compares two requests bit for bit); then the step
  is advanced as ``LLMEngine._advance_to_next_step`` does (computed tokens, one sampled token
  per sequence that samples).

Q/K/V of a token are fixed functions of (token id, position, layer): a token at the same
position in two requests has the same K/V, so a prefix-cache hit reads exactly what a
recompute would (the model's own matrix products, outside the shim, are taken as exact).

What it cannot model: the model's layers and sampler (next tokens are a fixed function of the
step), CUDA graphs, the native kernels of a GPU build, multi-step scheduling and the async
output processor.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/: the helpers package

from helpers.probes import report  # noqa: E402
from vllm_glue import (  # noqa: E402
    Runner,
    _fake_xformers,
    _forward,
    _inputs,
    _logprob,
    _native_cache_write,
    _path_counts,
    _prompt_path,
    _reshape_and_cache_cpu,
    _swap,
    seq_table,
)

BLOCK = 16
CHUNK = 32
HEADS, KV_HEADS, HEAD_SIZE = 4, 2, 64
VOCAB = 997
MAX_LEN = 512
#: The attention layers of this driver process (``main``'s options): head size, number of
#: layers, the dtype of Q/K/V and the cache, the kernels' compute mode and path (None: by
#: device).
SHAPE = {"head_size": HEAD_SIZE, "layers": 1, "dtype": "float32", "compute": None,
         "path": None}


class Tables:
    """The Q/K/V of a token as a function of (token id, position) for one layer, in the
    layer's dtype (drawn in float32)."""

    def __init__(self, seed: int = 0, head_size: int = HEAD_SIZE, dtype=None) -> None:
        import torch

        dtype = dtype or torch.float32
        g = torch.Generator().manual_seed(seed)
        self.q_tok = torch.randn(VOCAB, HEADS, head_size, generator=g).to(dtype)
        self.k_tok = torch.randn(VOCAB, KV_HEADS, head_size, generator=g).to(dtype)
        self.v_tok = torch.randn(VOCAB, KV_HEADS, head_size, generator=g).to(dtype)
        self.q_pos = (torch.randn(MAX_LEN, HEADS, head_size, generator=g) * 0.5).to(dtype)
        self.k_pos = (torch.randn(MAX_LEN, KV_HEADS, head_size, generator=g) * 0.5).to(dtype)

    def qkv(self, tokens, positions):
        q = self.q_tok[tokens] + self.q_pos[positions]
        k = self.k_tok[tokens] + self.k_pos[positions]
        v = self.v_tok[tokens]
        return q, k, v


class Engine:
    """The scheduler, the caches, one attention layer and the reference check."""

    last = None  # the engine of the scenario running now (its calls are reported on errors)

    def __init__(self, num_gpu_blocks: int = 64, num_cpu_blocks: int = 64,
                 preemption_mode=None, max_num_seqs: int = 8, chunked: bool = True) -> None:
        """``chunked``: chunked prefill in chunks of ``CHUNK`` tokens (every prompt then
        reaches ``forward_prefix``: vLLM gives each its block table); else whole prompts
        (those of a batch without a prefix-cache hit take the backend's prompt attention)."""
        import torch
        from vllm.config import CacheConfig, SchedulerConfig
        from vllm.core.scheduler import Scheduler
        from vllm.attention.backends.xformers import XFormersImpl
        from vllm.attention.ops.paged_attn import PagedAttention
        import vllm._custom_ops as ops

        if not _native_cache_write(BLOCK, KV_HEADS, HEAD_SIZE):
            ops.reshape_and_cache = _reshape_and_cache_cpu()[1]
        self.sched_config = SchedulerConfig(max_num_batched_tokens=CHUNK if chunked else MAX_LEN,
                                            max_num_seqs=max_num_seqs, max_model_len=MAX_LEN,
                                            enable_chunked_prefill=chunked,
                                            preemption_mode=preemption_mode)
        cache_config = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9,
                                   swap_space=0, cache_dtype="auto",
                                   enable_prefix_caching=True)
        cache_config.num_gpu_blocks = num_gpu_blocks
        cache_config.num_cpu_blocks = num_cpu_blocks
        self.scheduler = Scheduler(self.sched_config, cache_config, None)
        self.runner = Runner(self.sched_config, BLOCK, num_gpu_blocks, MAX_LEN)
        self.head_size = head = SHAPE["head_size"]
        self.dtype = getattr(torch, SHAPE["dtype"])
        self.impl = XFormersImpl(HEADS, head, head ** -0.5, KV_HEADS, None, None, "auto")
        g = torch.Generator().manual_seed(1)

        def cache(blocks):  # blocks nobody wrote hold noise, never zeros: reading one shows
            shape = PagedAttention.get_kv_cache_shape(blocks, BLOCK, KV_HEADS, head)
            return (torch.randn(shape, generator=g) * 3).to(self.dtype)

        layers = range(SHAPE["layers"])
        self.gpu = [cache(num_gpu_blocks) for _ in layers]  # one paged cache per layer
        self.cpu = [cache(num_cpu_blocks) for _ in layers]
        self.tables = [Tables(layer, head, self.dtype) for layer in layers]
        self.seqs: dict = {}
        self.next_seq_id = 0
        self.step_no = 0
        self.calls: list = []
        self.events: list = []
        #: (request id, layer, position) -> (the prompt row's output, the path that made it).
        self.rows: dict = {}
        self.extra: dict = {}  # what a scenario adds to its report
        Engine.last = self

    # -- requests --------------------------------------------------------------------------
    def add(self, request_id: str, prompt, max_tokens: int):
        from vllm.sampling_params import SamplingParams
        from vllm.sequence import Sequence, SequenceGroup

        seq = Sequence(self.next_seq_id, _inputs(list(prompt)), BLOCK)
        self.next_seq_id += 1
        group = SequenceGroup(request_id, [seq], time.time(),
                              SamplingParams(max_tokens=max_tokens, temperature=0.0))
        self.seqs[seq.seq_id] = (seq, max_tokens, request_id)
        self.scheduler.add_seq_group(group)
        return seq

    def finished(self) -> bool:
        return not self.scheduler.has_unfinished_seqs()

    # -- one engine step -------------------------------------------------------------------
    def schedule(self):
        """One call of vLLM's scheduler, counted as a step: (metadata list, outputs)."""
        metas, outputs = self.scheduler.schedule()[:2]
        self.step_no += 1
        return metas, outputs

    def build(self, metas):
        """The model input vLLM's V0 builder makes of the scheduled groups' metadata."""
        from vllm.worker.model_runner import ModelInputForGPUBuilder

        builder = ModelInputForGPUBuilder(self.runner, [])
        if hasattr(builder, "prepare"):  # 0.6.5+: one builder per runner, prepared per step
            builder.prepare([])
        for meta in metas:
            builder.add_seq_group(meta)
        return builder.build()

    def step(self) -> None:
        metas, outputs = self.schedule()
        self._move_blocks(outputs)
        if outputs.preempted:
            self.events.append(f"step {self.step_no}: {outputs.preempted} preempted")
        if not metas:
            return
        model_input = self.build(metas)
        md = model_input.attn_metadata
        if md is None:
            self._advance(metas, outputs)
            return
        tokens = model_input.input_tokens
        positions = model_input.input_positions
        n = tokens.shape[0]
        for layer, tables in enumerate(self.tables):
            q, k, v = tables.qkv(tokens, positions)
            before = _path_counts()
            out = _forward(self.impl, q.view(n, -1), k.view(n, -1), v.view(n, -1),
                           self.gpu[layer], md)
            path = _prompt_path(before, _path_counts())
            self._check(metas, model_input, q, out.view(n, HEADS, self.head_size), layer, path)
        self._advance(metas, outputs)

    def _move_blocks(self, outputs) -> None:
        """What the cache engine does with the scheduler's block moves: through the backend's
        ``swap_blocks`` (``PagedAttention.swap_blocks``) where the shim patched it (builds
        whose ops cannot swap), else test-side (the official CUDA wheel has no CPU op)."""
        from vllm.attention.backends.xformers import XFormersBackend
        from vllm.attention.ops.paged_attn import PagedAttention
        from vllm_bi100_patch.patching import registry

        via_shim = registry.is_ours(vars(PagedAttention)["swap_blocks"])
        for name, srcs, dsts in (("blocks_to_swap_out", self.gpu, self.cpu),
                                 ("blocks_to_swap_in", self.cpu, self.gpu)):
            pairs = list(getattr(outputs, name))
            if pairs:
                how = "shim swap_blocks" if via_shim else "test-side copy"
                self.events.append(f"step {self.step_no}: {name} {pairs} ({how})")
                for src, dst in zip(srcs, dsts):  # every layer's cache
                    if via_shim:
                        import torch

                        XFormersBackend.swap_blocks(src, dst,
                                                    torch.tensor(pairs, dtype=torch.int64))
                    else:
                        _swap(src, dst, pairs)
        copies = list(outputs.blocks_to_copy)
        if copies:
            self.events.append(f"step {self.step_no}: blocks_to_copy {copies}")
            for gpu in self.gpu:
                for s, d in copies:
                    gpu[:, d] = gpu[:, s]

    def _check(self, metas, model_input, q, out, layer: int = 0, path: str = "") -> None:
        """Every row against the dense float64 attention over its sequence's true tokens;
        prompt rows are kept in ``rows`` with ``path``."""
        from helpers.reference import attend, rel_error

        row = 0
        md = model_input.attn_metadata
        bt = md.prefill_metadata.block_tables if md.num_prefills else None
        prefill_i = 0
        tables = self.tables[layer]
        for (seq_id, is_prompt, computed), qlen in zip(_seq_rows(metas),
                                                       model_input.query_lens):
            seq, _, request = self.seqs[seq_id]
            true = seq.get_token_ids()
            pos = model_input.input_positions[row:row + qlen].tolist()
            kk = tables.k_tok[true[:pos[-1] + 1]] + tables.k_pos[:pos[-1] + 1]
            vv = tables.v_tok[true[:pos[-1] + 1]]
            ref = attend(q[row:row + qlen], kk, vv, pos, self.head_size ** -0.5)
            err = rel_error(out[row:row + qlen], ref)
            call = {"step": self.step_no, "seq": seq_id, "prompt": is_prompt,
                    "positions": [pos[0], pos[-1]], "err": err}
            if layer:
                call["layer"] = layer
            if is_prompt:
                call["path"] = path
                for i, p in enumerate(pos):
                    self.rows[(request, layer, p)] = (out[row + i].clone(), path)
            if is_prompt and bt is not None:
                call["table_cols"] = int(bt.shape[1])
                call["table"] = [int(b) for b in bt[prefill_i].tolist()]
                call["context_len"] = int(md.prefill_metadata.context_lens_tensor[prefill_i])
                call["own_table"] = list(seq_table(self.scheduler, seq_id))
                call["cached_blocks"] = list(computed or [])
                prefill_i += 1
            self.calls.append(call)
            row += qlen

    def _advance(self, metas, outputs) -> None:
        from vllm.sequence import SequenceStatus

        for meta, scheduled in zip(metas, outputs.scheduled_seq_groups):
            group = scheduled.seq_group
            group.update_num_computed_tokens(meta.token_chunk_size)
            if not meta.do_sample:
                continue
            for seq in group.get_seqs(status=SequenceStatus.RUNNING):
                token = (seq.seq_id * 131 + self.step_no * 17 + seq.get_len()) % VOCAB
                seq.append_token_id(token, {token: _logprob()})
                if seq.get_output_len() >= self.seqs[seq.seq_id][1]:
                    seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                    self.scheduler.free_seq(seq)
        self.scheduler.free_finished_seq_groups()

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if self.finished():
                return
            self.step()
        raise RuntimeError(f"requests not finished after {max_steps} steps")


def _seq_rows(metas):
    for meta in metas:
        for seq_id in meta.seq_data:
            yield seq_id, meta.is_prompt, meta.computed_block_nums


# -- scenarios -------------------------------------------------------------------------------
def _prompt(n, seed, offset=0):
    return [(seed * 7919 + offset + 31 * i) % VOCAB for i in range(n)]


def chunked_hit(hit_tokens: int, length: int = 128, shared=None):
    """A first request computes the shared prefix; a second, longer prompt starting with the
    same tokens is prefilled in chunks with the prefix-cache hit."""
    eng = Engine()
    shared = hit_tokens if shared is None else shared
    first = _prompt(shared, 1) + _prompt(BLOCK, 9, 5)
    eng.add("warm", first, 1)
    eng.run()
    second = first[:shared] + _prompt(length - shared, 2)
    eng.add("hit", second, 3)
    eng.run()
    return eng


def batch_shared():
    """Two requests share a prefix in one batch: one has the prefix-cache hit, the other
    (another prefix) has none; both in chunks, then decodes."""
    eng = Engine()
    prefix = _prompt(32, 3)
    eng.add("warm", prefix + _prompt(8, 4), 1)
    eng.run()
    # 80 tokens: chunks [0, 32) (a full hit: one token computed), [32, 64), then [64, 80)
    # shares its step with the first 16 tokens of the request without a hit.
    eng.add("hit", prefix + _prompt(48, 5), 4)
    eng.add("miss", _prompt(80, 6), 4)
    eng.run()
    return eng


def decode_steps():
    eng = Engine()
    eng.add("a", _prompt(40, 7), 12)
    eng.add("b", _prompt(21, 8), 12)
    eng.run()
    return eng


def preempt(mode: str):
    """Too few blocks for two growing requests: the later one is preempted (recompute: its
    prompt and outputs are prefilled again, partly from the prefix cache; swap: its blocks go
    to the CPU cache and come back)."""
    eng = Engine(num_gpu_blocks=9, num_cpu_blocks=16, preemption_mode=mode)
    eng.add("a", _prompt(60, 10), 24)
    eng.add("b", _prompt(50, 11), 24)
    eng.run()
    return eng


def long_decode():
    """Decode past VLLM_BI100_V1_MAX_SEQ_LEN (set small by the test)."""
    eng = Engine()
    eng.add("a", _prompt(40, 12), 40)
    eng.run()
    return eng


SCENARIOS = {
    "hit_lt_chunk": lambda: chunked_hit(16),
    "hit_eq_chunk": lambda: chunked_hit(32),
    "hit_gt_chunk": lambda: chunked_hit(64),
    "hit_inside_chunk": lambda: chunked_hit(48),
    "hit_inside_block": lambda: chunked_hit(32, shared=40),
    "batch_shared": batch_shared,
    "decode_steps": decode_steps,
    "preempt_recompute": lambda: preempt("recompute"),
    "preempt_swap": lambda: preempt("swap"),
    "long_decode": long_decode,
}


def _options(argv):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--head-size", type=int, default=HEAD_SIZE)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--compute", default=None, choices=("fp32", "native"),
                        help="force the shim kernels' compute mode (default: by device)")
    parser.add_argument("--path", default=None, choices=("sdpa", "tiled"),
                        help="force the prefix/prompt kernels' path (default: per row, by "
                             "device; every GPU takes the tiled path)")
    parser.add_argument("scenarios", nargs="*")
    return parser.parse_args(argv)


def main(argv, scenarios=None) -> None:
    scenarios = SCENARIOS if scenarios is None else scenarios
    opts = _options(argv)
    SHAPE.update(head_size=opts.head_size, layers=opts.layers, dtype=opts.dtype,
                 compute=opts.compute, path=opts.path)
    _fake_xformers()
    import vllm_bi100_patch
    from vllm_bi100_patch.attention.kernels.forced import forced

    # The kernels' test hooks, for every scenario (the engines' executor threads included).
    overrides = {name: value for name, value in (("compute", opts.compute), ("path", opts.path))
                 if value is not None}
    with forced(**overrides):
        for name in opts.scenarios or list(scenarios):
            Engine.last = None
            try:
                eng = scenarios[name]()
                report(scenario=name, ok=True, calls=eng.calls, events=eng.events,
                       status=vllm_bi100_patch.status(), shape=SHAPE, **eng.extra)
            except Exception as exc:
                eng = Engine.last
                report(scenario=name, ok=False, error=f"{type(exc).__name__}: {exc}",
                       trace=traceback.format_exc()[-3000:], calls=eng.calls if eng else [],
                       status=vllm_bi100_patch.status())


if __name__ == "__main__":
    main(sys.argv[1:])
