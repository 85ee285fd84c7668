"""A hermes tool call the output ended inside of (cut by ``max_tokens``), read without an ERROR
(row ``hermes_cut_call`` of ``vllm_bi100_patch.patching.table``; docs/serving-compat.md, "Tool calls cut
short").

With ``--enable-auto-tool-choice --tool-call-parser hermes``, the unstreamed answer reads the
model's output with ``Hermes2ProToolParser.extract_tool_calls``: every ``<tool_call>`` (closed
or running to the end of the text) is ``json.loads``-ed.  When ``max_tokens`` cuts the output
inside a call, that JSON is unfinished: 0.6.3's parser catches the ``JSONDecodeError``, logs
``ERROR Error in extracting tool call from response`` with its traceback (CoreX 3.2.3's
vendored parser: the ERROR line with the exception's message) and answers the whole output as
content, no calls (``finish_reason: "length"`` from the front end).  The answer is right; the
ERROR is not: a normal truncation fills an operator's log with errors.

The wrapper answers exactly that case itself, with the answer the original gives
(``tools_called=False``, no calls, the whole output as content) and one INFO line naming it:
the output's last ``<tool_call>`` is not closed, the text after it is empty or a proper prefix
of a JSON document (closing its string and brackets, with at most a placeholder value or key,
makes it JSON; ``json.loads`` does not read it as it is), and every closed call before it is a
JSON object with a name and arguments. The parser cannot see why the output ended
(``max_tokens``, a stop string, the model's own end of turn): an output that ends inside an
unfinished call is the same answer whatever ended it, and is logged as such (INFO). Everything
else goes to the original, so a call that is not JSON (a closed call with broken JSON, text
after a call's JSON, a call without a name) still logs 0.6.3's ERROR: the operator sees a model
that writes malformed calls.

Never imports vLLM: ``ExtractedToolCallInformation`` is read from the parser's module.
"""

from __future__ import annotations

import json
import re
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..activation import config
from ..activation.log import log
from ..patching import code_shapes
from ..patching.factories import ArgReader, Wrapper, counter
from ..patching.versions import Family

CUT = counter("hermes_cut_call")

OWNER, ATTR = "Hermes2ProToolParser", "extract_tool_calls"
PARAMS = ("self", "model_output", "request")
KNOWN: Dict[str, str] = {
    "481615d8c2a9abbe": "vLLM 0.6.3.post1 (the CoreX 3.2.3 stand-in keeps this file)",
    # Iluvatar's vendored tree (wudixzy/competition at 5a1c8c79,
    # vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py): 0.6.3.post1's method with
    # `logger.error("... %s", e)` for `logger.exception(...)`; the same branches and answer.
    "183eee1973f95926": "CoreX 3.2.3's vendored tree",
}


def check(func: Callable[..., Any]) -> Optional[str]:
    return code_shapes.shape_check(func, f"{OWNER}.{ATTR}", PARAMS, KNOWN)


#: What may follow an unfinished document's text before its brackets are closed: nothing, a
#: value (after ``:``, ``,`` or ``[``, or ending a number), a key's colon and value, a key.
_FILLERS = ("", "0", ":0", '"":0')
_LITERAL_END = re.compile(r"[a-z]+$")
_ESCAPE_END = re.compile(r"\\(u[0-9a-fA-F]{0,3})?$")  # a lone backslash, a partial unicode escape


def _unfinished(text: str) -> bool:
    """Whether ``text`` (what follows the last ``<tool_call>``) is empty or a proper prefix
    of a JSON document: what an output cut inside a call leaves."""
    text = text.strip()
    if not text:
        return True
    try:
        json.loads(text)
        return False  # complete: the original reads it
    except ValueError:
        pass
    except RecursionError:
        return False
    closers: List[str] = []
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            closers.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not closers or closers.pop() != ch:
                return False  # a bracket no prefix of a document has
    if in_string:  # closed where it stops, or before an escape it stops inside
        bases = [text + '"', _ESCAPE_END.sub("", text) + '"']
    else:
        word = _LITERAL_END.search(text)
        rest = next((lit[len(word.group()):] for lit in ("true", "false", "null")
                     if lit.startswith(word.group())), "") if word else ""
        bases = [text + rest]
    end = "".join(reversed(closers))
    for base in bases:
        for filler in _FILLERS:
            try:
                json.loads(base + filler + end)
            except (ValueError, RecursionError):
                continue
            return True
    return False


def _closed_calls_read(closed: List[str]) -> bool:
    """Whether every closed call is what the original reads: a JSON object with a name and
    arguments."""
    for body in closed:
        try:
            call = json.loads(body)
        except (ValueError, RecursionError):
            return False
        if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
            return False
    return True


def cut_inside_call(output: str, start: str, end: str) -> bool:
    """Whether ``output`` ends inside an unfinished tool call (its closed calls readable)."""
    last = output.rfind(start)
    if last < 0:
        return False
    tail = output[last + len(start):]
    if end in tail:
        return False
    closed = []
    for piece in output[:last].split(start)[1:]:
        if end not in piece:
            return False  # an unclosed call before another: the original decides
        closed.append(piece[:piece.index(end)])
    return _closed_calls_read(closed) and _unfinished(tail)


def make_wrapper(family: Family, original: Callable[..., Any], module: types.ModuleType,
                 settings: config.Settings) -> Wrapper:
    reader = ArgReader(PARAMS[1:], {}, ATTR)
    info_type = module.ExtractedToolCallInformation

    def extract_tool_calls(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                           kwargs: Dict[str, Any]) -> Any:
        output, _ = reader.read(args, kwargs)
        start = getattr(instance, "tool_call_start_token", None)
        end = getattr(instance, "tool_call_end_token", None)
        if not (isinstance(output, str) and isinstance(start, str) and isinstance(end, str)
                and start in output and cut_inside_call(output, start, end)):
            return wrapped(*args, **kwargs)
        CUT.add()
        log.info("vllm-bi100-patch: the output ends inside an unfinished tool call (cut by "
                 "max_tokens, a stop string or the model's end of turn): answered as text, no "
                 "calls, as vLLM does, without an error (row hermes_cut_call)")
        return info_type(tools_called=False, tool_calls=[], content=output)

    return extract_tool_calls


__all__: List[str] = ["check", "cut_inside_call", "make_wrapper"]
