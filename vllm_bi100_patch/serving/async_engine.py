"""``AsyncLLMEngine`` refuses what ``LLMEngine`` refuses, and its engine loop survives it.

Catalogue entry: row ``async_add_request`` of ``vllm_bi100_patch.patching.table``
(docs/serving-compat.md).  vLLM 0.6.3's ``_AsyncLLMEngine.add_request_async`` is its own copy of
``LLMEngine.add_request`` (the engine of ``AsyncLLMEngine``: the OpenAI server with
``--disable-frontend-multiprocessing``, ``run_batch``, library users), so the rows on
``LLMEngine`` do not reach it:

- a request whose ``n``/``best_of`` exceeds ``max_num_seqs`` is queued, the scheduler row
  ignores it, and the caller gets an empty text with ``finish_reason: "length"``, the cause
  only in the server log: refused instead, as ``seq_limit_engine`` refuses it
  (``seq_limit.refusal``);
- a guided request whose logits processor cannot be built raises what the backend raised out
  of the engine loop's ``add_request_async`` call, which catches only ``ValueError``: the loop
  stops and every request in flight fails.  Turned into ``GuidedDecodingUnavailable``, a
  ``ValueError`` naming the cause (``guided.refuse``), which the loop hands to that request
  alone.

Never imports vLLM.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Dict, Optional, Tuple

from ..activation import config
from ..patching.versions import Family
from ..patching import code_shapes
from . import guided, seq_limit
from ..patching.factories import Wrapper, counter

REFUSED = counter("async_add_request")

PARAMS = ("self", "request_id", "prompt", "params", "arrival_time", "lora_request",
          "trace_headers", "prompt_adapter_request", "priority", "inputs")
KNOWN: Dict[str, str] = {
    "8d638fd11939c411": "vLLM 0.6.3.post1; CoreX 3.2.3's vendored tree",
}


def check(func: Callable[..., Any]) -> Optional[str]:
    return code_shapes.shape_check(func, "_AsyncLLMEngine.add_request_async", PARAMS, KNOWN)


def make_wrapper(family: Family, original: Callable[..., Any], module: types.ModuleType,
                 settings: config.Settings) -> Wrapper:
    def add_request_async(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                          kwargs: Dict[str, Any]) -> Any:
        exc = seq_limit.refusal(instance, args, kwargs, "async_add_request")
        params = args[2] if len(args) > 2 else kwargs.get("params")
        guide = getattr(params, "guided_decoding", None)

        async def add() -> Any:
            if exc is not None:
                REFUSED.add()
                raise exc
            try:
                return await wrapped(*args, **kwargs)
            except ValueError:
                raise
            except Exception as error:
                if guide is None or not guided.from_builder(error):
                    raise
                backend = getattr(guide, "backend", None) or getattr(
                    getattr(instance, "decoding_config", None), "guided_decoding_backend",
                    None)
                request_id = args[0] if args else kwargs.get("request_id")
                raise guided.refuse(guide, backend, error, request_id,
                                    "async_add_request") from error

        return add()

    return add_request_async
