"""The OpenAI front end refuses a request it can never run before answering it.

Catalogue entries: rows ``seq_limit_client`` and ``seq_limit_openai`` of
``vllm_bi100_patch.patching.table`` (docs/serving-compat.md); the engine side is
``serving/seq_limit.py``.

vLLM 0.6.3's server runs its engine in a separate process by default (the front end holds an
``MQLLMEngineClient``), or in the front end's own process with
``--disable-frontend-multiprocessing`` (an ``AsyncLLMEngine``).  A chat or completion request
whose ``n``/``best_of`` exceeds ``max_num_seqs`` is refused by the engine's ``add_request``
only once queued there: a stream is answered 200 first.  Each front end gets its own row, and
each row's kill switch turns off that row alone:

- ``seq_limit_client``: the multiprocessing front end's client reads ``max_num_seqs`` from the
  engine configuration it is built with, and its ``generate`` refuses such a request with a
  ``ValueError`` (vLLM's serving classes answer it with a 400 before any stream starts);
- ``seq_limit_openai``: with the engine in the front end's process, ``_check_model`` answers
  such a request with a 400 naming n and ``max_num_seqs``.

Never imports vLLM.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Dict, Optional, Tuple

from ..activation import config
from ..patching.versions import Family
from ..patching import code_shapes
from ..patching.factories import Wrapper, counter
from .seq_limit import too_many

REFUSED_CLIENT = counter("seq_limit_client")
REFUSED_OPENAI = counter("seq_limit_openai")

CLIENT_PARAMS = ("self", "ipc_path", "engine_config")
CHECK_MODEL_PARAMS = ("self", "request")
#: Code shapes (``code_shapes.fingerprint``) each row was checked against.
CLIENT_KNOWN: Dict[str, str] = {
    "46c0e0f0c23a0d23": "vLLM 0.6.3.post1; CoreX 3.2.3's vendored tree",
}
CHECK_MODEL_KNOWN: Dict[str, str] = {
    "bd70fdf659738667": "vLLM 0.6.3.post1; CoreX 3.2.3's vendored tree",
}
#: The attribute holding the limit on a client built while the row was applied.
LIMIT_ATTR = "_vllm_bi100_max_num_seqs"


def check_client(func: Callable[..., Any]) -> Optional[str]:
    return code_shapes.shape_check(func, "MQLLMEngineClient.__init__", CLIENT_PARAMS,
                                   CLIENT_KNOWN)


def check_check_model(func: Callable[..., Any]) -> Optional[str]:
    return code_shapes.shape_check(func, "OpenAIServing._check_model", CHECK_MODEL_PARAMS,
                                   CHECK_MODEL_KNOWN)


def _asked(params: Any) -> Tuple[Any, Any]:
    """``(n, best_of)`` of a request's sampling parameters, as ``too_many`` takes them
    (``best_of`` has set ``n``; the asked ``n`` is ``_real_n``)."""
    real_n = getattr(params, "_real_n", None)
    n = real_n if isinstance(real_n, int) else getattr(params, "n", None)
    best_of = getattr(params, "best_of", None)
    return n, best_of if best_of and best_of != n else None


def make_client_wrapper(family: Family, original: Callable[..., Any], module: types.ModuleType,
                        settings: config.Settings) -> Wrapper:
    from ..patching import registry

    owner = vars(module)["MQLLMEngineClient"]

    def applied() -> bool:  # after revert(), a client built before passes everything on
        return registry.is_ours(vars(owner).get("__init__"))

    def __init__(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> Any:
        engine_config = args[1] if len(args) > 1 else kwargs.get("engine_config")
        limit = getattr(getattr(engine_config, "scheduler_config", None), "max_num_seqs", None)
        result = wrapped(*args, **kwargs)
        if isinstance(limit, int):
            vars(instance)[LIMIT_ATTR] = limit
            generate = instance.generate  # the class's, bound

            def checked_generate(*a: Any, **kw: Any) -> Any:
                params = a[1] if len(a) > 1 else kw.get("sampling_params")
                if applied():
                    n, best_of = _asked(params)
                    problem = too_many(n, best_of, limit)
                    if problem is not None:
                        REFUSED_CLIENT.add()
                        request_id = a[2] if len(a) > 2 else kw.get("request_id")
                        raise ValueError(f"request {request_id}: {problem}")
                return generate(*a, **kw)

            vars(instance)["generate"] = checked_generate
        return result

    return __init__


def limit_of(engine_client: Any) -> Optional[int]:
    """The ``max_num_seqs`` of an engine in the front end's own process
    (``AsyncLLMEngine.engine``), else None."""
    scheduler_config = getattr(getattr(engine_client, "engine", None), "scheduler_config", None)
    limit = getattr(scheduler_config, "max_num_seqs", None)
    return limit if isinstance(limit, int) else None


def make_check_model_wrapper(family: Family, original: Callable[..., Any],
                             module: types.ModuleType, settings: config.Settings) -> Wrapper:
    def _check_model(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                     kwargs: Dict[str, Any]) -> Any:
        async def checked() -> Any:
            result = await wrapped(*args, **kwargs)
            if result is not None:
                return result
            request = args[0] if args else kwargs.get("request")
            problem = too_many(getattr(request, "n", None), getattr(request, "best_of", None),
                               limit_of(instance.engine_client),
                               bool(getattr(request, "use_beam_search", False)))
            if problem is None:
                return None
            REFUSED_OPENAI.add()
            return instance.create_error_response(problem)

        return checked()

    return _check_model
