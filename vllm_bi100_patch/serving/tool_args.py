"""The tool calls a chat answer holds, read and checked (for row ``chat_tool_calls``:
``serving/tool_calls.py``; docs/serving-compat.md).

- ``CallArray``: the answer to ``tool_choice: "required"`` (guided by the schema of
  ``tool_choice.required_schema``: ``[{"name": ..., "parameters": {...}}, ...]``) read as it
  grows: each complete call as soon as its object closes, and at the end whether the array
  was complete; what is not a complete call stays text (nothing is lost: an answer cut by
  ``max_tokens`` keeps its unfinished part as content);
- ``check_call``: a call's arguments against the schema of its tool (sent with ``strict:
  true``): a violation is one WARNING naming the request and the tool (escaped) and one count
  of ``tool_arguments_invalid`` (the series ``vllm_bi100:tool_arguments_invalid_total``); where
  no check can be made (jsonschema missing, a schema it cannot read, arguments nested too
  deep, the check over its time budget: ``strict_schema``) one count of
  ``tool_arguments_unchecked`` and a WARNING once per cause.  The schema is applied as data
  only: nothing is retrieved, patterns run under the budget (``strict_schema``), the formats
  OpenAI's strict mode lists are checked (``json_formats``).

jsonschema is a dependency of vLLM 0.6.3's own (outlines, mistral_common), imported when a
call is first checked.  Never imports vLLM.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..activation.log import log
from ..patching.strict import warn_once
from ..patching.factories import counter
from . import json_formats, strict_schema
from .refusal import shown

INVALID = counter("tool_arguments_invalid")
UNCHECKED = counter("tool_arguments_unchecked")
_DECODER = json.JSONDecoder()
WHITESPACE = " \t\n\r"


def call_id() -> str:
    """A tool call id as vLLM makes them (``chatcmpl-tool-`` and a random hex)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def arguments_text(parameters: Any) -> str:
    """A call's parameters as the ``arguments`` JSON text."""
    return json.dumps(parameters, ensure_ascii=False)


class CallArray:
    """One answer to ``tool_choice: "required"``, fed as it grows (``feed``), read at its end
    (``finish``).  ``names``: the tools a call may name."""

    __slots__ = ("names", "text", "pos", "consumed", "state", "calls")

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.text = ""
        self.pos = 0            # where reading goes on
        self.consumed = 0       # the end of the last complete call (or of the closing "]")
        self.state = "start"    # start, item, sep, closed, bad
        self.calls = 0

    def feed(self, text: str) -> List[Tuple[str, str]]:
        """The calls (name, arguments text) completed by ``text``."""
        self.text += text
        out: List[Tuple[str, str]] = []
        while self.state not in ("closed", "bad"):
            i = self.pos
            while i < len(self.text) and self.text[i] in WHITESPACE:
                i += 1
            if i >= len(self.text):
                break
            ch = self.text[i]
            if self.state == "start":
                self.state, self.pos = ("item", i + 1) if ch == "[" else ("bad", i)
            elif self.state == "sep":
                if ch == ",":
                    self.state, self.pos = "item", i + 1
                elif ch == "]":
                    self.state, self.pos = "closed", i + 1
                    self.consumed = i + 1
                else:
                    self.state = "bad"
            else:  # an item
                try:
                    value, end = _DECODER.raw_decode(self.text, i)
                except (ValueError, RecursionError):
                    break  # not complete yet (or never: ``finish`` says which)
                call = self._call(value)
                if call is None:
                    self.state = "bad"
                    break
                out.append(call)
                self.calls += 1
                self.state, self.pos, self.consumed = "sep", end, end
        return out

    def _call(self, value: Any) -> Optional[Tuple[str, str]]:
        if not isinstance(value, dict) or value.get("name") not in self.names \
                or "parameters" not in value:
            return None
        try:
            return value["name"], arguments_text(value["parameters"])
        except (ValueError, RecursionError):
            return None

    def finish(self) -> Tuple[List[Tuple[str, str]], str, bool]:
        """The calls completed at the end, the text that is no complete call (content), and
        whether the answer was a complete array of at least one call."""
        calls = self.feed("")
        complete = self.state == "closed" and self.calls > 0 \
            and not self.text[self.consumed:].strip(WHITESPACE)
        rest = "" if complete else self.text[self.consumed:]
        return calls, rest, complete


def _violation(value: Any, schema: Any, until: float) -> Tuple[Optional[str], Optional[str]]:
    """(what in ``value`` breaks ``schema``, why no check could be made); both None: valid.
    The schema is applied as data only (``strict_schema``: no retrieval, patterns under the
    time budget, OpenAI's formats), until ``until`` (``time.monotonic()``)."""
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        return None, "jsonschema is not installed"
    try:
        error = strict_schema.violation(value, schema, until)
    except strict_schema.OverBudget:
        return None, (f"over budget: the check took more than {strict_schema.BUDGET_S} s (a "
                      "pattern or schema that costly to apply)")
    except strict_schema.Unchecked as exc:
        return None, str(exc)
    except RecursionError:
        return None, "a schema or arguments nested deeper than the check recurses"
    except Exception as exc:  # a schema jsonschema cannot use: never fail the answer
        return None, f"a schema jsonschema cannot use ({type(exc).__name__})"
    unknown, _, _ = strict_schema.scan(schema)
    if unknown:
        warn_once("tool call arguments are checked against the formats OpenAI's strict mode "
                  f"lists ({', '.join(json_formats.FORMATS)}); any other `format` of a strict "
                  "tool's schema is not checked (logged once per process)")
    if error is None:
        return None, None
    where = "/".join(str(p) for p in error.absolute_path) or "the top level"
    return f"{error.message} (at {where})", None


def check_call(request_id: str, name: str, arguments: Optional[str], schema: Any,
               until: Optional[float] = None) -> bool:
    """Check one call's ``arguments`` (JSON text) against its tool's ``schema`` within the
    check's time budget (until ``until``, ``time.monotonic()``; default: a budget of its own);
    log and count a violation.  True when valid (or not checkable).  It can take up to the
    budget: callers on an event loop run it in a thread (``tool_calls``)."""
    until = strict_schema.deadline() if until is None else until
    try:
        value = json.loads(arguments or "")
    except ValueError as exc:
        problem: Optional[str] = f"the arguments are not JSON ({exc})"
    except RecursionError:
        problem = None
        UNCHECKED.add()
        warn_once("tool call arguments nested deeper than the check parses were not checked "
                  "against their schema (counted in tool_arguments_unchecked)")
        return True
    else:
        problem, unchecked = _violation(value, schema, until)
        if unchecked is not None:
            UNCHECKED.add()
            warn_once(f"tool call arguments not checked against their schema: {unchecked} "
                      "(counted in tool_arguments_unchecked)")
            return True
    if problem is None:
        return True
    INVALID.add()
    log.warning("vllm-bi100-patch: request %s: the arguments of a call of tool %s do not match "
                "its schema (strict: true): %s; counted in vllm_bi100:tool_arguments_invalid",
                shown(request_id), shown(name), shown(problem))
    return False


def check_calls(request_id: str, calls: Sequence[Tuple[Optional[str], Optional[str]]],
                strict: Dict[str, Any]) -> None:
    """``check_call`` every call (name, arguments) of a strict tool, all within one time
    budget (``strict_schema.BUDGET_S``)."""
    until = strict_schema.deadline()
    for name, arguments in calls:
        if name is not None and name in strict:
            check_call(request_id, name, arguments, strict[name], until)


def malformed(request_id: str, text: str, finish_reason: Optional[str]) -> None:
    """An answer to ``tool_choice: "required"`` that is no complete call array although the
    model stopped by itself (guided decoding not applied): logged, counted as invalid."""
    INVALID.add()
    log.warning("vllm-bi100-patch: request %s: the answer to tool_choice \"required\" is not a "
                "complete array of tool calls (finish_reason %s; starts %s): returned as "
                "content; counted in vllm_bi100:tool_arguments_invalid", shown(request_id),
                shown(finish_reason), shown(text[:40]))


__all__: List[str] = ["CallArray", "arguments_text", "call_id", "check_call", "check_calls",
                      "malformed"]
