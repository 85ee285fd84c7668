"""Two tensor-parallel ranks (gloo, CPU) run a chunked prefill as vLLM's V0 workers do.

``python tp_logits.py SCENARIO`` spawns ranks 0 and 1.  Rank 0 (the driver worker) schedules
with vLLM's ``Scheduler`` (chunked prefill, ``max_num_batched_tokens`` 32), builds the model
input with the real ``ModelInputForGPUBuilder`` and ``SamplingMetadata.prepare`` (what
``ModelRunner.prepare_model_input`` does) and broadcasts it with vLLM's
``broadcast_tensor_dict``; rank 1 rebuilds it with
``ModelInputForGPUWithSamplingMetadata.from_broadcasted_tensor_dict`` (so its
``SamplingMetadata`` has ``seq_groups=None``, ``_init_sampling_metadata_from_tensor_dict``).
Both run the real ``LogitsProcessor`` over a ``ParallelLMHead`` split across the two ranks
(vLLM's gather to rank 0); rank 0 checks its logits against the full head and advances the
sequences as the engine does.  Each rank prints one report line (``helpers.probes.report``):
per step, how many tokens were selected and what ``LogitsProcessor`` returned (or raised).

What it cannot model: the model's layers (hidden states are a fixed function of token and
position), the sampler, NCCL, the vendor's ixformer collectives.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/: the helpers package
sys.path.insert(0, HERE)

VOCAB, HIDDEN, WORLD = 100, 16, 2


def _scenario(eng, name, prompt):
    if name in ("long", "mixed"):
        eng.add("long", prompt(80, 1), 3)  # chunks of 32, 32, 16: two steps sample nothing
    if name == "mixed":
        eng.add("short", prompt(10, 2), 2)


def _hidden(torch, tokens, positions):
    g = torch.Generator().manual_seed(7)
    table = torch.randn(1000, HIDDEN, generator=g)
    return table[tokens % 1000] + 0.01 * positions.view(-1, 1).float()


def _head(torch):
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    head = ParallelLMHead(VOCAB, HIDDEN)
    full = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(3))
    head.weight_loader(head.weight, full)  # vLLM shards the full weight itself
    return head, full


def _call(lp, head, hidden, metadata):
    try:
        out = lp(head, hidden, metadata)
    except Exception as exc:  # the worker would die here
        return None, f"{type(exc).__name__}: {exc}"
    return out, ("None" if out is None else f"tensor{list(out.shape)}")


def rank_main(rank: int, port: int, name: str) -> None:
    import torch
    from driver import _fake_xformers

    _fake_xformers()
    import vllm_bi100_patch
    from helpers.probes import report
    from vllm.attention.backends.xformers import XFormersBackend
    from vllm.distributed import (broadcast_tensor_dict, init_distributed_environment,
                                  initialize_model_parallel)
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.worker.model_runner import ModelInputForGPUWithSamplingMetadata

    init_distributed_environment(world_size=WORLD, rank=rank, local_rank=rank,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 backend="gloo")
    initialize_model_parallel(WORLD, 1, backend="gloo")
    head, full = _head(torch)
    lp = LogitsProcessor(VOCAB)
    steps = []
    try:
        if rank == 0:
            _driver(torch, name, lp, head, full, steps, broadcast_tensor_dict)
        else:
            while True:
                data = broadcast_tensor_dict(src=0)
                if not data:
                    break
                model_input = ModelInputForGPUWithSamplingMetadata.from_broadcasted_tensor_dict(
                    data, attn_backend=XFormersBackend)
                md = model_input.sampling_metadata
                hidden = _hidden(torch, model_input.input_tokens, model_input.input_positions)
                _, said = _call(lp, head, hidden, md)
                steps.append({"selected": int(md.selected_token_indices.numel()),
                              "seq_groups": None if md.seq_groups is None else len(md.seq_groups),
                              "result": said})
        report(scenario=name, rank=rank, ok=True, steps=steps, status=vllm_bi100_patch.status())
    except Exception as exc:
        report(scenario=name, rank=rank, ok=False, error=f"{type(exc).__name__}: {exc}",
               trace=traceback.format_exc()[-3000:], steps=steps)
    # The report is out: leave without the interpreter's teardown, where gloo's and the shm
    # broadcast's threads race (rank 0 once aborted there, "terminate called without an
    # active exception", after a correct run, under load); what is tested is above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _driver(torch, name, lp, head, full, steps, broadcast_tensor_dict) -> None:
    """Rank 0: the scheduler, the input builder, the broadcast, the logits, the advance."""
    from driver import Engine, _prompt
    from vllm.model_executor.sampling_metadata import SamplingMetadata
    from vllm.worker.model_runner import ModelInputForGPUWithSamplingMetadata

    eng = Engine()
    eng.runner._model_input_cls = ModelInputForGPUWithSamplingMetadata  # ModelRunner's
    _scenario(eng, name, _prompt)
    for _ in range(50):
        if eng.finished():
            break
        metas, outputs = eng.schedule()
        model_input = eng.build(metas)
        sampling = SamplingMetadata.prepare(metas, model_input.seq_lens, model_input.query_lens,
                                            "cpu", False, {})
        model_input = dataclasses.replace(model_input, sampling_metadata=sampling,
                                          is_prompt=metas[0].is_prompt, virtual_engine=0)
        broadcast_tensor_dict(model_input.as_broadcastable_tensor_dict(), src=0)
        hidden = _hidden(torch, model_input.input_tokens, model_input.input_positions)
        out, said = _call(lp, head, hidden, sampling)
        selected = sampling.selected_token_indices
        step = {"selected": int(selected.numel()), "seq_groups": len(sampling.seq_groups),
                "result": said, "chunks": [m.token_chunk_size for m in metas]}
        if out is not None and out.shape[0]:
            ref = hidden[selected] @ full.t()
            step["err"] = float((out - ref).abs().max())
        steps.append(step)
        eng._advance(metas, outputs)
    broadcast_tensor_dict({}, src=0)  # what the driver sends its workers to stop


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(name: str) -> None:
    import torch.multiprocessing as mp

    mp.spawn(rank_main, args=(_free_port(), name), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "long")
