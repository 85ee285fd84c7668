"""vLLM's own V0 ``Scheduler`` (block manager v2, no model) meets a request it can never run.

``main()`` (run by serving_app.py, in its interpreter) prints one report line per scenario
(``helpers.probes.report``):
a request asking for more parallel sequences (``n`` or ``best_of``) than ``max_num_seqs``,
then a plain request behind it, then ``schedule()`` called up to 50 times (each scheduled
prompt is finished as the engine would after its step, so the queue moves).  Reported: for each
request, the step it was scheduled at, or whether the scheduler returned it as ignored, and
the sequences' final status.  Then ``LLMEngine.add_request`` with the same parameters, on an
engine object that has only its ``scheduler_config`` (what the shim's check reads): refused
before anything is queued with the shim, and with the row off it goes on into vLLM's own
method (which then fails on the attributes this stand-in lacks).  And the multiprocessing front
end's engine client: the limit its ``__init__`` is given is what its ``generate`` refuses by.
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/: the helpers package

from helpers.probes import error_of, report  # noqa: E402

SCENARIOS = {  # name: (max_num_seqs, chunked prefill, n, best_of)
    "n2_max1": (1, False, 2, None),
    "n2_max1_chunked": (1, True, 2, None),
    "best_of2_max1": (1, False, 1, 2),
    "best_of2_max1_chunked": (1, True, 1, 2),
    "n257_max256": (256, False, 257, None),
    "n257_max256_chunked": (256, True, 257, None),
}
BLOCK = 16
PROMPT = 20


def scheduler(max_num_seqs, chunked):
    from vllm.config import CacheConfig, SchedulerConfig
    from vllm.core.scheduler import Scheduler

    config = SchedulerConfig(max_num_batched_tokens=max(64, max_num_seqs) if chunked else 512,
                             max_num_seqs=max_num_seqs, max_model_len=512,
                             enable_chunked_prefill=chunked)
    cache = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, swap_space=0,
                        cache_dtype="auto")
    cache.num_gpu_blocks = 4096
    cache.num_cpu_blocks = 0
    return Scheduler(config, cache, None)


def group(request_id, seq_id, n, best_of):
    from vllm.sampling_params import SamplingParams
    from vllm.sequence import Sequence, SequenceGroup

    try:
        from vllm.inputs import token_inputs
        inputs = token_inputs(list(range(1, PROMPT + 1)))
    except ImportError:
        inputs = {"prompt_token_ids": list(range(1, PROMPT + 1))}
    seq = Sequence(seq_id, inputs, BLOCK)
    params = SamplingParams(n=n, best_of=best_of, max_tokens=4)
    return SequenceGroup(request_id, [seq], time.time(), params)


def run(name, max_num_seqs, chunked, n, best_of):
    from vllm.sequence import SequenceStatus

    sched = scheduler(max_num_seqs, chunked)
    big, plain = group("big", 0, n, best_of), group("plain", 1, 1, None)
    sched.add_seq_group(big)
    sched.add_seq_group(plain)
    first = {}
    ignored = []
    for step in range(50):
        _, out, _ = sched.schedule()
        ignored += [g.request_id for g in out.ignored_seq_groups]
        for scheduled in out.scheduled_seq_groups:
            g = scheduled.seq_group
            first.setdefault(g.request_id, step)
            for seq in g.get_seqs():  # finished after its step, as the engine would
                if not seq.is_finished():
                    seq.status = SequenceStatus.FINISHED_STOPPED
        sched.free_finished_seq_groups()
        if not sched.waiting and not sched.running:
            break
    report(scenario=name, scheduled=first, ignored=ignored,
           waiting=[g.request_id for g in sched.waiting],
           big_status=[s.status.name for s in big.get_seqs()],
           max_num_seqs=max_num_seqs)


def add_request(name, max_num_seqs, n, best_of):
    from vllm.config import SchedulerConfig
    from vllm.engine.llm_engine import LLMEngine
    from vllm.sampling_params import SamplingParams

    engine = object.__new__(LLMEngine)
    engine.scheduler_config = SchedulerConfig(512, max_num_seqs, 512)
    params = SamplingParams(n=n, best_of=best_of, max_tokens=4)
    report(scenario=name, error=error_of(lambda: engine.add_request("req-1", "hello",
                                                                     params)))


def client_limit(max_num_seqs):
    """The multiprocessing front end's engine client (vLLM's ``MQLLMEngineClient``, built from
    an engine configuration as ``vllm serve`` builds it, no engine behind it): the limit it
    read, and what its ``generate`` does with n over it."""
    import asyncio
    import types

    import engine_harness
    from vllm import SamplingParams
    from vllm.engine.multiprocessing.client import MQLLMEngineClient

    model, _, parallel, scheduler, *_ = engine_harness.configs(max_num_seqs)
    config = types.SimpleNamespace(model_config=model, scheduler_config=scheduler,
                                   parallel_config=parallel, lora_config=None,
                                   decoding_config=engine_harness.configs()[8])

    async def run():
        client = MQLLMEngineClient("ipc:///tmp/bi100-no-engine", config)
        try:
            return (vars(client).get("_vllm_bi100_max_num_seqs"),
                    error_of(lambda: client.generate("hi", SamplingParams(n=max_num_seqs + 1),
                                                     "r1")))
        finally:
            client.close()

    recorded, error = asyncio.run(run())
    report(scenario="client_limit", recorded=recorded, error=error)


def main():
    for name, (max_num_seqs, chunked, n, best_of) in SCENARIOS.items():
        run(name, max_num_seqs, chunked, n, best_of)
    add_request("add_request_n2_max1", 1, 2, None)
    add_request("add_request_best_of2_max1", 1, 1, 2)
    client_limit(7)


if __name__ == "__main__":
    main()
