"""The OpenAI front end's empty error messages (vLLM 0.6.3): the exception named instead.

Catalogue entry: row ``error_message_cause`` of ``vllm_bi100_patch.table`` (with
``chat_request_compat``, ``patches/chat_compat.py``, the serving rows of
``docs/serving-compat.md``).  0.6.3 answers ``create_error_response(str(e))``; an exception
without a message (``TimeoutError()`` of a remote image fetch) gives a 400 with an empty
message.  The wrapper names the exception being handled instead.

Never imports vLLM.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import config
from ..versions import Family
from . import code_shapes
from ._common import Wrapper, counter

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
    return (f"{type(exc).__name__} (raised without a message, as a remote image fetch that "
            "timed out raises TimeoutError(); the server log has the traceback)")


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
