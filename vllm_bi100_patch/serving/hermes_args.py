"""Streamed hermes tool calls of vLLM 0.6.3 whose arguments are what the model wrote (row
``hermes_tool_args`` of ``vllm_bi100_patch.patching.table``; docs/serving-compat.md, "Streamed tool
calls (hermes)").

0.6.3's ``Hermes2ProToolParser.extract_tool_calls_streaming`` streams a call's arguments as
differences between ``json.dumps`` of ``partial_json_parser``'s completions of the text so far
(an unfinished string is closed, so the differences are wrong: ``'{"city": "city'``), looks a
delta's text up in them with ``str.index`` (an error logged when the delta holds more) and
sends nothing for a call whose JSON comes in one delta; then
``OpenAIServingChat.chat_completion_stream_generator`` replaces the finishing chunk's delta,
when it carries arguments, by ``json.dumps(the parsed arguments).replace(what was streamed,
"", 1)`` (``_should_check_for_unstreamed_tool_arg_tokens``): the last ``}`` or the whole
arguments lost or doubled, that delta's name and content dropped.

While this row is installed (``live``), the hermes parser's wrapper
(``tool_stream.make_parser_wrapper``, row ``hermes_tool_start``) answers every delta with
``stream``: the choice's reading (``hermes_reading.Stream``) fed the delta, the parser's own
state kept as 0.6.3 keeps it for the front end (a call is in ``prev_tool_call_arr`` once named,
so the finish reason is ``"tool_calls"``), the DeltaMessage marked as made here; the wrapper of
``_should_check_for_unstreamed_tool_arg_tokens`` answers False for such a delta (nothing is
left unstreamed), so the finishing chunk keeps it.

The stream generator shares one parser among the ``n`` choices of a request: each choice's
reading is stored under its token list (the front end passes the previous delta's
``current_token_ids`` as ``previous_token_ids``); for any other caller it is rebuilt from
``previous_text``.  Never imports vLLM: the DeltaMessage class is read from the parser's
module.
"""

from __future__ import annotations

import json
import sys
import types
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..activation import config
from ..activation.log import log
from ..patching import versions
from ..patching.patch_row import SERVING_CHAT
from ..patching.versions import Family
from ..patching import code_shapes
from ..patching.factories import Wrapper, counter
from .hermes_reading import Entry, Stream

CALLS = counter("hermes_tool_args")
KEPT = counter("hermes_finish_kept")

OWNER, ATTR = "OpenAIServingChat", "_should_check_for_unstreamed_tool_arg_tokens"
CHECK_PARAMS = ("self", "delta_message", "output")
CHECK_KNOWN: Dict[str, str] = {
    "ce9ca9f4d4134512": "vLLM 0.6.3.post1; CoreX 3.2.3's vendored tree (wudixzy/competition at "
                        "5a1c8c79, vllm/entrypoints/openai/serving_chat.py)",
}


#: id -> a weak reference to each DeltaMessage made here (``ours``).
_MADE: Dict[int, Any] = {}


def _mark(delta: Any) -> Any:
    key = id(delta)

    def gone(ref: Any, key: int = key) -> None:
        if _MADE.get(key) is ref:
            del _MADE[key]

    _MADE[key] = weakref.ref(delta, gone)
    return delta


def ours(delta: Any) -> bool:
    """Whether ``delta`` is a DeltaMessage this module made."""
    ref = _MADE.get(id(delta))
    return ref is not None and ref() is delta


def _reading(parser: Any, previous_text: str, previous_ids: Any) -> Stream:
    """The choice's reading: the one stored under its previous token list, else a new one
    that has read ``previous_text`` (a caller other than the front end)."""
    entry = parser.__dict__.setdefault("_bi100_hermes_readings", {}).pop(id(previous_ids),
                                                                          None)
    if entry is not None and entry[0] is previous_ids and entry[1].text == previous_text:
        return entry[1]
    reading = Stream()
    if previous_text:
        reading.feed(previous_text)
    return reading


def _keep_state(parser: Any, entry: Entry, delta_call: Dict[str, Any]) -> None:
    """The parser's own state as 0.6.3 keeps it for the front end."""
    if entry.slot is None:
        entry.slot = len(parser.prev_tool_call_arr)
        parser.prev_tool_call_arr.append({"name": entry.call.name, "arguments": {}})
        parser.streamed_args_for_tool.append("")
        parser.current_tool_id, parser.current_tool_name_sent = entry.slot, True
        CALLS.add()
    parser.streamed_args_for_tool[entry.slot] += delta_call["function"].get("arguments", "")
    if entry.call.args_end is not None and not entry.parsed:
        entry.parsed = True
        try:
            parser.prev_tool_call_arr[entry.slot]["arguments"] = json.loads(
                entry.call.arguments())
        except ValueError:
            pass  # not JSON: the unstreamed answer says so


def stream(parser: Any, module: types.ModuleType, previous_text: str, delta_text: str,
           previous_ids: Any, current_ids: Any) -> Any:
    """The DeltaMessage for one delta of a choice (None: nothing to send yet)."""
    try:
        reading = _reading(parser, previous_text, previous_ids)
        content, calls = reading.feed(delta_text)
    except Exception:  # never the stream's end: what is lost is said
        log.exception("vllm-bi100-patch: the hermes tool call stream could not be read "
                      "(row hermes_tool_args); this delta (%r) is not sent", delta_text[:200])
        return None
    parser.__dict__["_bi100_hermes_readings"][id(current_ids)] = (current_ids, reading)
    for entry, delta_call in calls:
        _keep_state(parser, entry, delta_call)
    if calls:
        fields: Dict[str, Any] = {"tool_calls": [d for _, d in calls]}
        if content:
            fields["content"] = content
    elif content or reading.open is None:
        fields = {"content": content}
    else:
        return None
    return _mark(module.DeltaMessage(**fields))


def live() -> bool:
    """Whether this row is installed in this process now (the hermes parser's wrapper,
    ``tool_stream.make_parser_wrapper``, streams with ``stream`` only then)."""
    serving = sys.modules.get(SERVING_CHAT)
    cls = vars(serving).get(OWNER) if serving is not None else None
    if not isinstance(cls, type):
        return False
    from ..patching import registry

    return registry.is_ours(vars(cls).get(ATTR))


def args_needed(module: types.ModuleType, settings: config.Settings) -> Optional[str]:
    """None on vLLM 0.6.3 with row ``hermes_tool_start`` on; else why not needed."""
    if "hermes_tool_start" in settings.disabled:
        return ("row hermes_tool_start is disabled: its wrapper of the hermes parser's "
                "extract_tool_calls_streaming streams the arguments this row keeps")
    return versions.only_063()


def check(func: Callable[..., Any]) -> Optional[str]:
    return code_shapes.shape_check(func, f"{OWNER}.{ATTR}", CHECK_PARAMS, CHECK_KNOWN)


def make_finish_wrapper(family: Family, original: Callable[..., Any],
                        module: types.ModuleType, settings: config.Settings) -> Wrapper:
    def _should_check_for_unstreamed_tool_arg_tokens(wrapped: Callable[..., Any],
                                                     instance: Any, args: Tuple[Any, ...],
                                                     kwargs: Dict[str, Any]) -> Any:
        delta = args[0] if args else kwargs.get("delta_message")
        if delta is None or not ours(delta):
            return wrapped(*args, **kwargs)
        if wrapped(*args, **kwargs):
            KEPT.add()  # 0.6.3 would have replaced this finishing delta
        return False

    return _should_check_for_unstreamed_tool_arg_tokens


__all__: List[str] = ["args_needed", "check", "live",
                      "make_finish_wrapper", "ours", "stream"]
