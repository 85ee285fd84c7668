"""``POST /v1/responses`` on vLLM 0.6.3's OpenAI app (row ``responses_api`` of
``vllm_bi100_patch.patching.table``; docs/serving-compat.md, "The Responses API").

``build_app`` is wrapped: every app it builds gets the route.  A request is read as the chat
completion it asks for (``responses_request.chat_body``), validated by the app's own chat
request class (the chat row's, where it is installed: its mappings, refusals and client-schema
limits apply), answered by the app's ``OpenAIServingChat.create_chat_completion`` (with every
serving row on it: tool plans, strict checks, hermes streaming, finish chunks, reasoning) and
written back as a Responses object or event stream (``responses_answer``).  Its output items
are kept for a while (``responses_store``: bounded, in memory) unless ``store`` is false, so a
later ``item_reference`` can name them; responses are not: ``previous_response_id`` is refused
by name.

A body that is not JSON, too deep for the parser, or that names a field the server cannot
serve gets a 400 naming it, before anything reaches the engine; an error answer of the chat
path keeps its status.  Never imports vLLM: the app's classes are read from the target module
(``vllm.entrypoints.openai.api_server``).
"""

import json
import types
from typing import Any, AsyncIterator, Callable, Dict, Optional, Tuple

from ..activation import config
from ..activation.log import log
from ..patching import code_shapes, versions
from ..patching.factories import Wrapper, counter
from ..patching.versions import Family
from . import responses_answer, responses_request, responses_store
from .refusal import RequestRefused
from .request_body import warn_once

PATH = "/v1/responses"
SERVED = counter("responses_api")
REFUSED = counter("responses_refused")
HOSTED = counter("responses_hosted_tools")

PARAMS = ("args",)
KNOWN: Dict[str, str] = {
    # 0.6.3.post1's build_app; CoreX 3.2.3's api_server.py is 0.6.3's (the vendor's tree
    # changes serving_chat.py, not the app).
    "b27b5c4fe23bb77d": "vLLM 0.6.3.post1; CoreX 3.2.3's vendored tree",
}
#: What the route reads from the app module, besides ``build_app``.
NEEDS = ("router", "Request", "JSONResponse", "StreamingResponse", "ErrorResponse",
         "ChatCompletionRequest", "ChatCompletionResponse")


def responses_needed(module: types.ModuleType, settings: config.Settings) -> Optional[str]:
    """None on vLLM 0.6.3 whose app has no ``/v1/responses`` route; else why not needed."""
    why = versions.only_063()
    if why:
        return why
    router = getattr(module, "router", None)
    for route in getattr(router, "routes", ()):
        if getattr(route, "path", None) == PATH:
            return f"this vLLM's app serves {PATH} itself"
    return None


def check(func: Callable[..., Any]) -> Optional[str]:
    module = __import__("sys").modules.get(getattr(func, "__module__", ""))
    missing = [n for n in NEEDS if module is None or not hasattr(module, n)]
    if missing:
        return f"the API server module has no {', '.join(missing)}"
    return code_shapes.shape_check(func, "build_app", PARAMS, KNOWN)


def _error(module: types.ModuleType, serving: Any, message: str, status: int = 400) -> Any:
    err = serving.create_error_response(message=message)
    body = err.model_dump()
    body["code"] = status
    return module.JSONResponse(body, status_code=status)


def _read(body: bytes) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    try:
        data = json.loads(body)
    except RecursionError:
        raise RequestRefused(f"{PATH}: the body is nested too deeply to read") from None
    except ValueError as exc:
        raise RequestRefused(f"{PATH}: the body is not JSON ({exc})") from None
    return responses_request.chat_body(data)


async def _events(module: types.ModuleType, stream: AsyncIterator[str], response_id: str,
                  model: str, echo: Dict[str, Any]) -> AsyncIterator[str]:
    events = responses_answer.Events(response_id, model, echo)
    for event in events.start():
        yield event
    async for piece in stream:
        for line in piece.split("\n"):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            try:
                chunk = json.loads(line[len("data: "):])
            except ValueError:
                continue
            for event in events.feed(chunk):
                yield event
    for event in events.end():
        yield event
    if echo.get("store"):
        responses_store.keep(events.final()["output"])


def make_build_app_wrapper(family: Family, original: Callable[..., Any],
                           module: types.ModuleType, settings: config.Settings) -> Wrapper:
    async def create_response(raw_request: Any) -> Any:
        serving = raw_request.app.state.openai_serving_chat
        try:
            chat, echo = _read(await raw_request.body())
            request = module.ChatCompletionRequest.model_validate(chat)
        except (RequestRefused, ValueError) as exc:  # pydantic's ValidationError included
            REFUSED.add()
            message = str(exc)
            log.info("vllm-bi100-patch: %s refused: %s", PATH, message[:300])
            return _error(module, serving, message)
        SERVED.add()
        for kind in echo["hosted_tools_dropped"]:
            warn_once(HOSTED, PATH, f"hosted tool {kind!r}", "OpenAI runs it on its own "
                      "servers; this one cannot: the model is not offered it")
        response_id = responses_answer.new_id("resp")
        answer = await serving.create_chat_completion(request, raw_request)
        if isinstance(answer, module.ErrorResponse):
            return module.JSONResponse(answer.model_dump(), status_code=answer.code)
        if isinstance(answer, module.ChatCompletionResponse):
            obj = responses_answer.response(answer.model_dump(), response_id, echo)
            if echo.get("store"):
                responses_store.keep(obj["output"])
            return module.JSONResponse(obj)
        return module.StreamingResponse(
            _events(module, answer, response_id, request.model, echo),
            media_type="text/event-stream")

    create_response.__annotations__ = {"raw_request": module.Request}

    def build_app(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                  kwargs: Dict[str, Any]) -> Any:
        app = wrapped(*args, **kwargs)
        if not any(getattr(r, "path", None) == PATH for r in app.router.routes):
            app.add_api_route(PATH, create_response, methods=["POST"])
        return app

    return build_app


__all__ = ["check", "make_build_app_wrapper", "responses_needed"]
