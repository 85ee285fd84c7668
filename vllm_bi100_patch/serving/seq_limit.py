"""A request that asks for more parallel sequences than ``max_num_seqs`` never stops the server.

Catalogue entries: rows ``unschedulable_group``, ``seq_limit_engine`` (here),
``async_add_request`` (``serving/async_engine.py``), ``seq_limit_client`` and
``seq_limit_openai`` (``serving/seq_limit_front.py``) of ``vllm_bi100_patch.patching.table``
(docs/serving-compat.md).

In vLLM 0.6.3 a request with ``n`` (or ``best_of``, which sets ``n``) parallel sequences is one
``SequenceGroup``; at the prompt stage ``get_max_num_running_seqs()`` is ``n``.  The V0
scheduler's ``_schedule_prefills`` ``break``s on the first waiting group that does not fit the
budget, and nothing compares ``n`` with ``max_num_seqs``: a group with ``n > max_num_seqs``
never fits, so it and every request behind it wait forever.  The loop's other ``break``s pass:
allocation ``LATER`` (``NEVER`` is ignored already), an exhausted token budget or
``num_new_tokens == 0`` (both free up as running requests finish; a prompt over the token
limit is ignored already) and the prefill delay.  vLLM 0.6.4 runs parallel sampling as groups
of one (``ParallelSampleSequenceGroup``, pull request #9302); where a build has it the rows
report themselves not needed.

- ``unschedulable_group``: every such group leaves the waiting queue as ignored, wherever it
  waits (a head waiting for a LoRA slot is skipped by the loop, so a group behind it would
  block the queue too), as vLLM does for a prompt over the limit (one WARNING naming it), and
  the requests behind it are scheduled.
- ``seq_limit_engine``: ``LLMEngine.add_request`` refuses it before it is queued
  (``ValueError``, which vLLM's front end answers with a 400); ``refusal`` is the check, also
  for ``_AsyncLLMEngine.add_request_async`` (its own copy of ``add_request``).

Never imports vLLM.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable, Dict, Optional, Tuple

from ..activation import config
from ..patching.counting import metrics
from ..patching import versions
from ..activation.log import log
from ..patching.versions import Family
from ..patching import code_shapes
from ..patching.factories import Wrapper, counter

IGNORED = counter("unschedulable_group")
REFUSED_ENGINE = counter("seq_limit_engine")
PR = "vLLM pull request #9302"

SCHEDULER_PARAMS = ("self", "budget", "curr_loras", "enable_chunking")
ADD_REQUEST_PARAMS = ("self", "request_id", "prompt", "params", "arrival_time", "lora_request",
                      "trace_headers", "prompt_adapter_request", "priority", "inputs")

#: Code shapes (``code_shapes.fingerprint``) each row was checked against.
SCHEDULER_KNOWN: Dict[str, str] = {
    "34fb8672dd7443c1": "vLLM 0.6.3.post1; CoreX 3.2.3's vendored tree",
}
ADD_REQUEST_KNOWN: Dict[str, str] = {
    "26163a797f4556a4": "vLLM 0.6.3.post1; CoreX 3.2.3's vendored tree",
}


def limit_needed(module: types.ModuleType, settings: config.Settings) -> Optional[str]:
    """None where the build runs a request's parallel sequences as one group (vLLM 0.6.3);
    else why the rows are not needed."""
    sequence = sys.modules.get("vllm.sequence")
    if sequence is None:
        return "vllm.sequence is not loaded (no V0 engine here)"
    if isinstance(vars(sequence).get("ParallelSampleSequenceGroup"), type):
        return f"this build runs parallel sampling as groups of one ({PR}, vLLM 0.6.4)"
    return versions.only_063()


def check_scheduler(func: Callable[..., Any]) -> Optional[str]:
    return code_shapes.shape_check(func, "Scheduler._schedule_prefills", SCHEDULER_PARAMS,
                                   SCHEDULER_KNOWN)


def check_add_request(func: Callable[..., Any]) -> Optional[str]:
    return code_shapes.shape_check(func, "LLMEngine.add_request", ADD_REQUEST_PARAMS,
                                   ADD_REQUEST_KNOWN)


def too_many(n: Any, best_of: Any, limit: Optional[int], use_beam_search: bool = False
             ) -> Optional[str]:
    """Why a request with ``n``/``best_of`` can never run under ``max_num_seqs = limit``, or
    None.  (Beam search's ``n`` is its width, run as requests of one: not counted.)"""
    if limit is None or use_beam_search:
        return None
    wanted = max(v for v in (n, best_of, 1) if isinstance(v, int))
    if wanted <= limit:
        return None
    asked = f"n={n}" + (f" and best_of={best_of}" if isinstance(best_of, int) else "")
    return (f"{asked} asks for {wanted} parallel sequences, but this server runs at most "
            f"max_num_seqs={limit} sequences at once (--max-num-seqs): the request could never "
            f"be scheduled; send n and best_of of at most {limit}")


def make_scheduler_wrapper(family: Family, original: Callable[..., Any],
                           module: types.ModuleType, settings: config.Settings) -> Wrapper:
    status = module.SequenceStatus

    def _schedule_prefills(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                           kwargs: Dict[str, Any]) -> Any:
        waiting = instance.waiting
        limit = instance.scheduler_config.max_num_seqs
        # the whole queue, not only its head: the loop skips a head waiting for a LoRA slot
        # and would then break on an unschedulable group behind it (issue 35, defect 7)
        oversize = [g for g in waiting if g.get_max_num_running_seqs() > limit]
        for group in oversize:
            waiting.remove(group)
            wanted = group.get_max_num_running_seqs()
            for seq in group.get_seqs(status=status.WAITING):
                seq.status = status.FINISHED_IGNORED
            IGNORED.add()
            log.warning("vllm-bi100-patch: request %s asks for %d parallel sequences (n or "
                        "best_of) and exceeds max_num_seqs=%d: ignored, it could never be "
                        "scheduled (row unschedulable_group)", group.request_id, wanted, limit)
        result = wrapped(*args, **kwargs)
        if oversize:
            result.ignored_seq_groups[:0] = oversize
        return result

    return _schedule_prefills


def refusal(instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], row: str
            ) -> Optional[ValueError]:
    """The ``ValueError`` an ``add_request`` call (``self`` bound; ``request_id, prompt,
    params, ...``) gets when its ``n``/``best_of`` exceeds the engine's ``max_num_seqs``, or
    None; counted for ``row``."""
    params = args[2] if len(args) > 2 else kwargs.get("params")
    n = getattr(params, "n", None)  # SamplingParams (best_of has set n); pooling: none
    if not isinstance(n, int):
        return None
    real_n = getattr(params, "_real_n", None)
    best_of = getattr(params, "best_of", None)
    problem = too_many(real_n if isinstance(real_n, int) else n,
                       best_of if best_of and best_of != real_n else None,
                       instance.scheduler_config.max_num_seqs)
    if problem is None:
        return None
    request_id = args[0] if args else kwargs.get("request_id")
    exc = ValueError(f"request {request_id}: {problem}")
    metrics.TALLY.refused(row, exc)
    return exc


def make_add_request_wrapper(family: Family, original: Callable[..., Any],
                             module: types.ModuleType, settings: config.Settings) -> Wrapper:
    def add_request(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                    kwargs: Dict[str, Any]) -> Any:
        exc = refusal(instance, args, kwargs, "seq_limit_engine")
        if exc is not None:
            REFUSED_ENGINE.add()
            raise exc
        return wrapped(*args, **kwargs)

    # vLLM's own refusals (LoRA, priority) are not this row's: it counts only its own
    return metrics.counts_own_refusals(add_request)


def on_063(module: types.ModuleType, settings: config.Settings) -> Optional[str]:
    """The ``when`` check of a serving row checked against vLLM 0.6.3's code only."""
    return versions.only_063()
