"""A guided request whose logits processor cannot be built is refused, naming the cause.

Catalogue entry: row ``guided_decoding_errors`` of ``vllm_bi100_patch.patching.table`` (its async
twin is part of ``async_add_request``, ``serving/async_engine.py``; docs/serving-compat.md,
"Guided decoding").  vLLM 0.6.3 builds a guided request's logits processor when the engine
adds it (``LLMEngine._build_logits_processors``; ``_AsyncLLMEngine.add_request_async`` has its
own asynchronous copy).  What fails there (outlines that cannot import, a schema or regex the
backend cannot compile) raises whatever the backend raised: vLLM's front end answers only a
``ValueError`` with a 400, so the client gets a 500 or a broken stream, and in the
``AsyncLLMEngine`` (whose engine loop catches only ``ValueError``) the exception stops the
engine loop: every request in flight fails.  The row turns such an exception into a
``GuidedDecodingUnavailable`` (a ``ValueError``) naming the backend, the request's kind of
guide and the cause; the original is its ``__cause__``.

Never imports vLLM.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Dict, Optional, Tuple

from ..activation import config
from ..patching.counting import metrics
from ..activation.log import log
from ..patching.versions import Family
from ..patching import code_shapes
from ..patching.factories import Wrapper, counter

REFUSED = counter("guided_decoding_errors")

BUILD_PARAMS = ("self", "sampling_params", "lora_request")
BUILD_KNOWN: Dict[str, str] = {
    "1a331b28a654f5be": "vLLM 0.6.3.post1; CoreX 3.2.3's vendored tree",
}
#: Where a guided request's processor is built: an exception raised in one of these modules
#: (or their imports) is the guide's.
BUILDERS = ("vllm.model_executor.guided_decoding", "outlines", "lmformatenforcer",
            "interegular", "lark", "pyairports")


class GuidedDecodingUnavailable(ValueError):
    """A guided request's logits processor cannot be built here (vLLM's front end answers a
    ``ValueError`` with a 400)."""


def check_build(func: Callable[..., Any]) -> Optional[str]:
    return code_shapes.shape_check(func, "LLMEngine._build_logits_processors", BUILD_PARAMS,
                                   BUILD_KNOWN)


def from_builder(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while a guided-decoding backend built its processor (a
    frame of ``BUILDERS`` in its traceback)."""
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_globals.get("__name__", "")
        if name.startswith(BUILDERS) or tb.tb_frame.f_code.co_name == (
                "build_guided_decoding_logits_processor_async"):
            return True
        tb = tb.tb_next
    return False


def _kind(guided: Any) -> str:
    for name in ("json", "regex", "choice", "grammar", "json_object"):
        if getattr(guided, name, None):
            return name
    return "guide"


def _hint(exc: BaseException) -> str:
    missing = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    if missing and missing.split(".")[0] == "pyairports":
        return ("; outlines 0.0.x imports pyairports.airports, and the pyairports on PyPI "
                "is an unrelated upload since 2025 (vLLM issue #23983): the shim's row "
                "guided_decoding_imports supplies it unless disabled, or use "
                "--guided-decoding-backend lm-format-enforcer (or the request's "
                "guided_decoding_backend)")
    if isinstance(exc, ImportError):
        return "; the guided-decoding backend cannot be imported on this server"
    return ""


def unavailable(guided: Any, backend: Any, exc: BaseException) -> GuidedDecodingUnavailable:
    """The ``ValueError`` a guided request gets when its processor cannot be built."""
    cause = f"{type(exc).__name__}: {exc}" if str(exc).strip() else type(exc).__name__
    return GuidedDecodingUnavailable(
        f"guided decoding ({_kind(guided)}, backend {backend or 'default'}) cannot be built "
        f"on this server: {cause}{_hint(exc)}")


def refuse(guided: Any, backend: Any, exc: BaseException, request_id: Any, row: str
           ) -> GuidedDecodingUnavailable:
    """Count, log and return the refusal of ``exc`` (to raise ``from exc``)."""
    out = unavailable(guided, backend, exc)
    REFUSED.add()
    metrics.TALLY.refused(row, out)
    log.warning("vllm-bi100-patch: %s refused: %s (row %s)",
                "a guided request" if request_id is None else f"request {request_id}", out, row)
    return out


def make_build_wrapper(family: Family, original: Callable[..., Any], module: types.ModuleType,
                       settings: config.Settings) -> Wrapper:
    def _build_logits_processors(wrapped: Callable[..., Any], instance: Any,
                                 args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        params = args[0] if args else kwargs.get("sampling_params")
        guided = getattr(params, "guided_decoding", None)
        try:
            return wrapped(*args, **kwargs)
        except ValueError:
            raise  # a 400 already, with vLLM's (or the backend's) own message
        except Exception as exc:
            if guided is None or not from_builder(exc):
                raise
            backend = getattr(guided, "backend", None) or getattr(
                getattr(instance, "decoding_config", None), "guided_decoding_backend", None)
            raise refuse(guided, backend, exc, None, "guided_decoding_errors") from exc

    return metrics.counts_own_refusals(_build_logits_processors)
