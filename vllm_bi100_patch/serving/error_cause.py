"""The OpenAI front end's empty error messages (vLLM 0.6.3): the exception named instead.

Catalogue entry: row ``error_message_cause`` of ``vllm_bi100_patch.patching.table`` (with
``chat_request_compat``, ``serving/chat_compat.py``, the serving rows of
``docs/serving-compat.md``).  0.6.3 answers ``create_error_response(str(e))``; an exception
without a message (``TimeoutError()`` of a remote image fetch, a chat template's
``raise_exception('')``) gives a 400 with an empty message.  The wrapper names the exception
being handled instead, and says what is known of it by its own kind: its chained cause, a
template error, a time-out; nothing more where nothing more is known.

Never imports vLLM.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..activation import config
from ..patching.versions import Family
from ..patching import code_shapes
from ..patching.factories import Wrapper, counter

ERRORS = counter("error_message_cause")

ERROR_PARAMS = ("self", "message", "err_type", "status_code")
ERROR_KNOWN: Dict[str, str] = {
    "4e45ccf5d1389af8": "vLLM 0.6.3.post1; CoreX 3.2.3's vendored tree",
}


def check_error(func: Callable[..., Any]) -> Optional[str]:
    return code_shapes.shape_check(func, "OpenAIServing.create_error_response", ERROR_PARAMS,
                                   ERROR_KNOWN)


def _cause() -> str:
    exc = sys.exc_info()[1]
    if exc is None:
        return "the request failed with an error without a message (see the server log)"
    if str(exc).strip():
        return f"{type(exc).__name__}: {exc}"
    return (f"{type(exc).__name__} (raised without a message{_what(exc)}; the server log has "
            "the traceback)")


def _what(exc: BaseException) -> str:
    """What is known of a message-less exception, by its own kind: its chained cause's
    message, else what such an exception means on this path; nothing when unknown."""
    chained = exc.__cause__ or exc.__context__
    if chained is not None and str(chained).strip():
        return f"; caused by {type(chained).__name__}: {chained}"
    mro = [(c.__module__.split(".")[0], c.__name__) for c in type(exc).__mro__]
    if ("jinja2", "TemplateError") in mro:
        return ("; the chat template failed on this request, e.g. its raise_exception() "
                "with an empty message")
    if isinstance(exc, TimeoutError):
        return ("; a time-out, e.g. fetching an image or audio URL the request names (vLLM's "
                "VLLM_IMAGE_FETCH_TIMEOUT, VLLM_AUDIO_FETCH_TIMEOUT)")
    return ""


def make_error_wrapper(family: Family, original: Callable[..., Any], module: types.ModuleType,
                       settings: config.Settings) -> Wrapper:
    def create_error_response(wrapped: Callable[..., Any], instance: Any,
                              args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        message = args[0] if args else kwargs.get("message")
        if isinstance(message, str) and not message.strip():
            ERRORS.add()
            cause = _cause()
            if args:
                args = (cause,) + tuple(args[1:])
            else:
                kwargs = dict(kwargs, message=cause)
        return wrapped(*args, **kwargs)

    return create_error_response


__all__: List[str] = ["check_error", "make_error_wrapper"]
