"""A batch ``LLM.generate`` refuses leaves nothing queued.

Catalogue entry: row ``llm_batch_refusal`` of ``vllm_bi100_patch.patching.table``
(docs/serving-compat.md).  vLLM 0.6.3's ``LLM._validate_and_add_requests`` adds a batch's
requests to its engine one by one; when one is refused (``ValueError``: n over
``max_num_seqs``, a prompt too long, a guide that cannot be built, a LoRA not enabled), the
requests before it stay queued, and the next ``generate()`` returns their outputs mixed with
its own.  The wrapper withdraws (``LLMEngine.abort_request``) every request the refused call
added, logs one WARNING naming them, and re-raises the refusal unchanged.

Never imports vLLM.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Dict, Optional, Set, Tuple

from ..activation import config
from ..activation.log import log
from ..patching.versions import Family
from ..patching import code_shapes
from ..patching.factories import Wrapper, counter

WITHDRAWN = counter("llm_batch_refusal")

PARAMS = ("self", "prompts", "params", "lora_request", "prompt_adapter_request",
          "guided_options", "priority")
KNOWN: Dict[str, str] = {
    "3d1e99f210a989a9": "vLLM 0.6.3.post1; CoreX 3.2.3's vendored tree",
}


def check(func: Callable[..., Any]) -> Optional[str]:
    return code_shapes.shape_check(func, "LLM._validate_and_add_requests", PARAMS, KNOWN)


def queued_ids(engine: Any) -> Set[str]:
    """The request ids in every scheduler of ``engine`` (waiting, running, swapped)."""
    out: Set[str] = set()
    for scheduler in getattr(engine, "scheduler", ()):
        for queue in (scheduler.waiting, scheduler.running, scheduler.swapped):
            out.update(group.request_id for group in queue)
    return out


def make_wrapper(family: Family, original: Callable[..., Any], module: types.ModuleType,
                 settings: config.Settings) -> Wrapper:
    def _validate_and_add_requests(wrapped: Callable[..., Any], instance: Any,
                                   args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        engine = instance.llm_engine
        before = queued_ids(engine)
        try:
            return wrapped(*args, **kwargs)
        except BaseException as exc:
            added = sorted(queued_ids(engine) - before)
            if added:
                engine.abort_request(added)
                WITHDRAWN.add(len(added))
                log.warning("vllm-bi100-patch: LLM.generate's batch was refused (%s: %s); "
                            "withdrew the %d request(s) of it already queued (%s), so that "
                            "no later call returns them (row llm_batch_refusal)",
                            type(exc).__name__, exc, len(added), ", ".join(added))
            raise

    return _validate_and_add_requests
