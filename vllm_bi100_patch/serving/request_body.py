"""What the OpenAI request rows share (``chat_request_compat``: ``serving/chat_compat.py``,
``completion_request_compat``: ``serving/completion_compat.py``; docs/serving-compat.md).

- ``warn_once``: the once-per-process WARNING for a field or key that is dropped, over a bounded
  set of names: the names this module knows are warned about one by one, names a client made up
  (message keys) under one capped bucket, every name escaped (``refusal.shown``) so that a body can
  never write a line of its own into the log;
- the mappings both endpoints make: the fields that change nothing a self-hosted server does,
  ``stream_options``, ``response_format: json_schema`` -> ``guided_json`` (its schema given as
  an object or as JSON text);
- ``request_class``: the subclass of a vLLM 0.6.3 request model whose pydantic *wrap* validator
  maps the raw body before 0.6.3's own validators, and turns what those validators crash on
  (``TypeError``, ``KeyError``, ``RecursionError`` ... from a malformed or deeply nested body:
  a 500 in 0.6.3) into a 400 naming it.

Every mapping copies what it changes (the caller's objects are never changed) and never
copies or walks a value it does not change, so a body nested as deep as the JSON parser allows
is served as vLLM 0.6.3 serves it.  Never imports vLLM (pydantic is imported when a class is
built: vLLM's front end has it).
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable, Dict, List, Tuple

from ..activation.log import log
from ..patching.counting.counters import Counter
from .refusal import RequestRefused, shown


#: Names made up by clients (message keys no message type has) warned about one by one, at
#: most this many per process; the rest under one line.
MADE_UP_CAP = 16
_OVERFLOW = "(more made-up names)"
_warned: set = set()
_made_up: set = set()
_warned_lock = threading.Lock()


def warn_once(counter: Counter, endpoint: str, what: str, why: str, made_up: str = "") -> None:
    """Count one dropped field and WARN once per process per name.  ``what``: a name this
    package knows (its own text); ``made_up``: a client's name (shown escaped), one of at most
    ``MADE_UP_CAP`` warned about (then one line for all further ones)."""
    counter.add()
    if made_up:
        with _warned_lock:
            if made_up in _made_up or _OVERFLOW in _made_up:
                return
            if len(_made_up) >= MADE_UP_CAP:
                _made_up.add(_OVERFLOW)
                what = f"{what} (more than {MADE_UP_CAP} different names: further ones are "
                what += "dropped without a WARNING)"
            else:
                _made_up.add(made_up)
                what = f"{what} {shown(made_up)}"
    else:
        with _warned_lock:
            if (endpoint, what) in _warned:
                return
            _warned.add((endpoint, what))
    log.warning("vllm-bi100-patch: %s requests' %s accepted and ignored (%s); logged once per "
                "process", endpoint, what, why)


def reset_warnings() -> None:
    """Forget which names were warned about (tests)."""
    with _warned_lock:
        _warned.clear()
        _made_up.clear()


#: Fields of both endpoints that change nothing a self-hosted server answers: dropped, each
#: named once in a WARNING.
IGNORED_BOTH: Dict[str, str] = {
    "prompt_cache_retention": "how long OpenAI keeps a cached prompt prefix; vLLM's prefix "
                              "cache needs no retention policy",
    "prompt_cache_options": "OpenAI's prompt-cache settings; vLLM's prefix cache takes none",
}
OBFUSCATION = "include_obfuscation"


def drop_ignored(data: Dict[str, Any], fields: frozenset, ignored: Dict[str, str],
                 counter: Counter, endpoint: str) -> bool:
    """Drop the ``ignored`` fields the model does not have (each warned once)."""
    changed = False
    for name, why in ignored.items():
        if name in data and name not in fields:
            del data[name]
            warn_once(counter, endpoint, f"field `{name}`", why)
            changed = True
    return changed


def stream_options(data: Dict[str, Any], counter: Counter, endpoint: str) -> bool:
    """``stream_options``: usage on the final chunk only unless ``continuous_usage_stats`` is
    asked for (vLLM 0.6.4's default; 0.6.3's is true: usage on every chunk);
    ``include_obfuscation`` dropped (warned once)."""
    options = data.get("stream_options")
    if not isinstance(options, dict):
        return False
    new = dict(options)
    if OBFUSCATION in new:
        del new[OBFUSCATION]
        warn_once(counter, endpoint, f"field `stream_options.{OBFUSCATION}`",
                  "OpenAI's random padding of streamed chunks against size side channels; "
                  "the chunks' content is the same without it")
    if "continuous_usage_stats" not in new:
        new["continuous_usage_stats"] = False
    if new == options:
        return False
    data["stream_options"] = new
    return True


def json_object(value: Any, where: str) -> Dict[str, Any]:
    """``value`` (a schema) as a JSON object: a dict as it is, JSON text parsed; else a
    ``RequestRefused`` naming ``where`` and why."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise RequestRefused(f"`{where}` is a string but not JSON text ({exc})") from None
        except RecursionError:
            raise RequestRefused(f"`{where}` nests deeper than this server parses") from None
        if not isinstance(value, dict):
            raise RequestRefused(f"`{where}` is the JSON text of a {type(value).__name__}, not "
                                 "of an object (a JSON schema)")
        return value
    if not isinstance(value, dict):
        raise RequestRefused(f"`{where}` must be a JSON schema (an object), not a "
                             f"{type(value).__name__}")
    return value


def same(a: Any, b: Any, what: str) -> bool:
    """``a == b``, or a ``RequestRefused`` when they nest too deeply to compare."""
    try:
        return bool(a == b)
    except RecursionError:
        raise RequestRefused(f"{what} nest deeper than this server compares") from None


def response_format(data: Dict[str, Any]) -> bool:
    """``response_format: {"type": "json_schema", ...}`` -> ``guided_json`` (vLLM 0.6.4,
    #9530), its schema given as an object or as JSON text (parsed; the format then holds the
    object too).  A ``guided_json`` beside it must be the same schema (object or text).  Every
    client schema guided here is checked (``client_schema.check``: resolved only within itself,
    within limits), and an empty one is guided as a JSON object (``client_schema.guided``)."""
    from . import client_schema

    fmt = data.get("response_format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return False
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestRefused("`response_format.json_schema` is missing: a json_schema "
                             "response format needs {\"name\": ..., \"schema\": {...}}")
    if spec.get("schema") is None:
        raise RequestRefused("`response_format.json_schema.schema` is missing: a json_schema "
                             "response format needs the schema")
    schema = json_object(spec["schema"], "response_format.json_schema.schema")
    if schema is not spec["schema"]:
        data["response_format"] = dict(fmt, json_schema=dict(spec, schema=schema))
    client_schema.check(schema, "response_format.json_schema.schema")
    guided = data.get("guided_json")
    if guided is not None:
        other = json_object(guided, "guided_json")
        if not same(other, schema, "`guided_json` and `response_format.json_schema.schema`") \
                and not same(other, client_schema.guided(schema), "`guided_json`"):
            raise RequestRefused("`guided_json` and `response_format.json_schema` give two "
                                 "different schemas")
    data["guided_json"] = client_schema.guided(schema)  # vLLM 0.6.4 (#9530): enforced
    return True


def guided_json(data: Dict[str, Any]) -> bool:
    """A client's own ``guided_json`` (an object, or JSON text of one) checked
    (``client_schema.check``); ``{}`` guided as a JSON object.  Whether it changed."""
    from . import client_schema

    guided = data.get("guided_json")
    if isinstance(guided, str):
        try:
            parsed = json.loads(guided)
        except ValueError:
            return False  # 0.6.3's guided decoding refuses it by name
        except RecursionError:
            raise RequestRefused("`guided_json` nests deeper than this server parses") from None
        if not isinstance(parsed, dict):
            return False
        client_schema.check(parsed, "guided_json")
        if not parsed:
            data["guided_json"] = client_schema.guided(parsed)
            return True
        return False
    if isinstance(guided, dict):
        client_schema.check(guided, "guided_json")
        if not guided:
            data["guided_json"] = client_schema.guided(guided)
            return True
    return False


#: What vLLM 0.6.3's own validators raise on some malformed bodies (a 500 there, pydantic
#: passing them on): turned into a 400 naming the exception.
CRASHES = (TypeError, KeyError, AttributeError, IndexError, RecursionError)

#: ``mapping(body) -> (new body, changed, plan)``; ``plan`` (or None) gets the validated
#: request (``plan.attach(request)``).
Mapping = Callable[[Dict[str, Any]], Tuple[Dict[str, Any], bool, Any]]
PLAN_ATTR = "_vllm_bi100_plan"


def request_class(original: Any, mapping: Mapping, counter: Counter) -> type:
    """The subclass of ``original`` (a vLLM 0.6.3 request model) that maps the raw body with
    ``mapping`` inside its own validation (``counter`` counts the bodies it changed)."""
    from pydantic import PrivateAttr, model_validator

    class Request(original):  # type: ignore[misc, valid-type]
        _vllm_bi100_plan: Any = PrivateAttr(default=None)

        @model_validator(mode="wrap")
        @classmethod
        def _vllm_bi100_compat(cls, data: Any, handler: Callable[[Any], Any]) -> Any:
            plan = None
            if isinstance(data, dict):
                from . import client_schema

                try:
                    with client_schema.request():
                        data, changed, plan = mapping(data)
                except RecursionError:
                    raise RequestRefused("the request body nests deeper than this server "
                                         "handles") from None
                if changed:
                    counter.add()
            try:
                request = handler(data)
            except CRASHES as exc:
                raise RequestRefused(
                    f"the request body could not be validated: vLLM 0.6.3's validation "
                    f"raised {type(exc).__name__} ({shown(str(exc))}); check the types of "
                    "the fields it names") from None
            if plan is not None and isinstance(request, cls):
                plan.attach(request)
            return request

    Request.__name__ = original.__name__
    Request.__module__ = original.__module__
    Request.__qualname__ = original.__qualname__
    Request.__doc__ = original.__doc__
    return Request


def plan_of(request: Any) -> Any:
    """The plan ``request_class`` attached to a validated request (None for any other)."""
    try:
        return getattr(request, PLAN_ATTR, None)
    except Exception:  # a model without private attributes
        return None


def field_names(original: Any) -> frozenset:
    """The model's fields and their aliases (a field the model has is never touched)."""
    fields = frozenset(original.model_fields)
    for field in original.model_fields.values():
        if field.alias:
            fields |= {field.alias}
    return fields


__all__: List[str] = ["CRASHES", "IGNORED_BOTH", "RequestRefused", "drop_ignored",
                      "field_names", "guided_json", "json_object", "plan_of", "request_class",
                      "response_format", "reset_warnings", "same", "shown", "stream_options",
                      "warn_once"]
