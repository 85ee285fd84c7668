"""vLLM 0.6.3's own engines meet what the serving rows are for (engine_harness.py: the real
``LLMEngine``, ``AsyncLLMEngine`` and ``LLM``, a stand-in executor), one report line per
scenario (``helpers.probes.report``).  Run with the shim (``VLLM_BI100_PATCH=1``), without,
and with single rows disabled (``VLLM_BI100_PATCH_DISABLE``).

- ``async_n_over``: ``AsyncLLMEngine.generate`` with n=5 under ``max_num_seqs=4``.
- ``async_guided``: an ``AsyncLLMEngine`` gets a guided request (a choice), one whose guide
  cannot be built (a regex outlines cannot compile), then a plain one: what each caller gets,
  and whether the engine still runs.
- ``engine_guided``: the same two guides through ``LLMEngine.add_request`` (what the
  multiprocessing engine and ``LLM`` use), and what is left queued.
- ``llm_refused_batch_*``: an ``LLM.generate`` batch whose last request is refused (n over
  ``max_num_seqs``; an empty prompt, refused by vLLM itself), then a plain ``generate()``:
  what it returns.
- ``lora_hol``: vLLM's ``Scheduler`` with LoRA (``max_loras=1``): a LoRA request running, a
  second LoRA request waiting at the head (no slot), an unschedulable n=3 group behind it
  (``max_num_seqs=2``), then a plain request: the step each is scheduled at.
- ``mq_client``: the multiprocessing front end's ``MQLLMEngineClient``, built from an engine
  configuration with ``max_num_seqs=4``: whether its ``generate`` refuses n=5.
- ``run_batch``: ``run_batch``'s own ``BatchRequestInput`` validates a line whose body has
  ``max_completion_tokens``.
- ``status``: the shim's ``status()`` (rows applied, counts, class bindings, guided imports).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/: the helpers package
sys.path.insert(0, HERE)

import engine_harness  # noqa: E402
from helpers.probes import error_of, report  # noqa: E402

CHOICE = ["yes", "no"]
BAD_REGEX = "(?<=a)b"  # a look-behind: outlines' regex parser (interegular) refuses it


def _guided(**kw):
    from vllm.sampling_params import GuidedDecodingParams, SamplingParams

    return SamplingParams(max_tokens=2, guided_decoding=GuidedDecodingParams(**kw))


async def _collect(engine, request_id, params, prompt="hello"):
    try:
        final = None
        async for out in engine.generate(prompt, params, request_id):
            final = out
        return {"outputs": [(o.text, o.finish_reason) for o in final.outputs]}
    except BaseException as exc:  # noqa: B902 - what the caller gets
        return {"error": f"{type(exc).__name__}: {exc}"}


def async_n_over():
    from vllm import SamplingParams

    async def run():
        engine = engine_harness.async_engine(max_num_seqs=4)
        return await _collect(engine, "big", SamplingParams(n=5, max_tokens=3))

    report(scenario="async_n_over", **asyncio.run(run()))


def async_guided():
    from vllm import SamplingParams

    async def run():
        engine = engine_harness.async_engine()
        out = {"choice": await _collect(engine, "g1", _guided(choice=CHOICE)),
               "bad_regex": await _collect(engine, "g2", _guided(regex=BAD_REGEX)),
               "plain": await _collect(engine, "p1", SamplingParams(max_tokens=2)),
               "errored": engine.errored}
        return out

    report(scenario="async_guided", **asyncio.run(run()))


def engine_guided():
    engine = engine_harness.llm_engine()
    out = {}
    for name, params in (("choice", _guided(choice=CHOICE)),
                         ("bad_regex", _guided(regex=BAD_REGEX))):
        out[name] = error_of(lambda n=name, p=params: engine.add_request(n, "hello", p))
        if out[name] == "no error":
            out[name + "_processors"] = [type(p).__name__ for p in params.logits_processors]
        out[name + "_unfinished"] = engine.get_num_unfinished_requests()
        engine.abort_request(name)
    report(scenario="engine_guided", **out)


def llm_refused_batch(name, last):
    from vllm import SamplingParams

    llm = engine_harness.llm()
    prompts = ["one", "two", last[0]]
    params = [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2), last[1]]
    error = error_of(lambda: llm.generate(prompts, params, use_tqdm=False))
    queued = llm.llm_engine.get_num_unfinished_requests()
    outs = llm.generate(["three"], SamplingParams(max_tokens=2), use_tqdm=False)
    report(scenario=name, error=error, queued_after=queued,
           next_call=[o.prompt for o in outs])


def lora_hol():
    from vllm.config import CacheConfig, LoRAConfig, SchedulerConfig
    from vllm.core.scheduler import Scheduler
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.sequence import Logprob, Sequence, SequenceGroup, SequenceStatus

    config = SchedulerConfig(512, 2, 512)
    cache = CacheConfig(16, 0.9, 0, "auto")
    cache.num_gpu_blocks, cache.num_cpu_blocks = 1024, 0
    sched = Scheduler(config, cache, LoRAConfig(max_lora_rank=8, max_loras=1))

    def group(request_id, seq_id, n, lora, max_tokens):
        from vllm.inputs import token_inputs

        seq = Sequence(seq_id, token_inputs(list(range(1, 21))), 16,
                       lora_request=lora)
        return SequenceGroup(request_id, [seq], time.time(),
                             SamplingParams(n=n, max_tokens=max_tokens), lora_request=lora)

    lora1, lora2 = LoRARequest("a", 1, lora_path="/nonexistent/a"), LoRARequest(
        "b", 2, lora_path="/nonexistent/b")
    groups = [group("lora1", 0, 1, lora1, 40), group("lora2", 1, 1, lora2, 2),
              group("big", 2, 3, None, 2), group("plain", 3, 1, None, 2)]
    sched.add_seq_group(groups[0])
    first, ignored = {}, []
    for step in range(60):
        if step == 1:  # the LoRA request runs; the others arrive
            for g in groups[1:]:
                sched.add_seq_group(g)
        _, out, _ = sched.schedule()
        ignored += [g.request_id for g in out.ignored_seq_groups]
        for scheduled in out.scheduled_seq_groups:  # what the engine does after the step
            g = scheduled.seq_group
            first.setdefault(g.request_id, step)
            g.update_num_computed_tokens(scheduled.token_chunk_size)
            for seq in g.get_seqs(status=SequenceStatus.RUNNING):
                seq.append_token_id(5, {5: Logprob(0.0)})
                if seq.get_output_len() >= g.sampling_params.max_tokens:
                    seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        sched.free_finished_seq_groups()
        if not sched.waiting and not sched.running:
            break
    report(scenario="lora_hol", scheduled=first, ignored=ignored,
           waiting=[g.request_id for g in sched.waiting])


def mq_client():
    import types

    from vllm import SamplingParams
    from vllm.engine.multiprocessing.client import MQLLMEngineClient
    from vllm.entrypoints.openai import serving_engine  # noqa: F401 - its rows apply too

    model, cache, parallel, scheduler = engine_harness.configs()[:4]
    config = types.SimpleNamespace(model_config=model, scheduler_config=scheduler,
                                   parallel_config=parallel, lora_config=None,
                                   decoding_config=engine_harness.configs()[8])

    async def run():
        client = MQLLMEngineClient("ipc:///tmp/bi100-no-engine", config)
        try:
            result = error_of(lambda: client.generate("hello", SamplingParams(n=5), "big"))
            within = error_of(lambda: client.generate("hello", SamplingParams(n=4), "ok"))
        finally:
            client.close()
        return result, within

    refused, within = asyncio.run(run())
    report(scenario="mq_client", n5=refused, n4=within)


def run_batch():
    from vllm.entrypoints.openai import run_batch as rb

    line = json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "tiny", "max_completion_tokens": 3,
                                "messages": [{"role": "user", "content": "hi"}]}})
    parsed = {}

    def validate():
        parsed["body"] = rb.BatchRequestInput.model_validate_json(line).body

    report(scenario="run_batch", error=error_of(validate),
           max_tokens=getattr(parsed.get("body"), "max_tokens", None),
           cls=type(parsed.get("body")).__module__ if parsed else None)


def _active():
    try:
        import vllm_bi100_patch
    except ImportError:
        return False
    return bool(vllm_bi100_patch.status()["active"])


SCENARIOS = {"async_n_over": async_n_over, "async_guided": async_guided,
             "engine_guided": engine_guided, "lora_hol": lora_hol, "mq_client": mq_client,
             "run_batch": run_batch}


def main(names):
    from vllm import SamplingParams

    for name in names:
        if name == "llm_refused_batch":
            if _active():  # stock vLLM queues n=5 and never runs it: generate() never returns
                llm_refused_batch("llm_refused_batch_n", ("three", SamplingParams(n=5)))
            llm_refused_batch("llm_refused_batch_empty", ({"prompt_token_ids": []},
                                                          SamplingParams(max_tokens=2)))
        elif name != "async_n_over" or _active():  # stock: queued, never run
            SCENARIOS[name]()
    try:
        import vllm_bi100_patch

        st = vllm_bi100_patch.status()
        report(scenario="status", applied=(st["report"] or {}).get("applied"),
               skipped=(st["report"] or {}).get("skipped"), counts=st["counts"],
               class_bindings=st.get("class_bindings"), guided_imports=st.get("guided_imports"))
    except ImportError:
        report(scenario="status", applied=None)


if __name__ == "__main__":
    main(sys.argv[1:] or [*SCENARIOS, "llm_refused_batch"])
