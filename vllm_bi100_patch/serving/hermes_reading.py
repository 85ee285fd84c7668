"""One choice's streamed hermes output read as it grows, for row ``hermes_tool_args``
(``serving/hermes_args.py``; docs/serving-compat.md, "Streamed tool calls (hermes)").

``Stream.feed(delta)``: the content and the tool call deltas (dicts as 0.6.3's
``DeltaToolCall``) that one delta of text adds.  Text outside ``<tool_call>`` ...
``</tool_call>`` is content: the text before the first call as it comes; text between or
after calls only once it is more than whitespace (the unstreamed answer drops it: whitespace
that stays whitespace is never sent).  A tag is a tag once its text is complete (hermes models
emit each as one token; a tag split between deltas may leave its first characters in the
content).  In each call's JSON object (``Call``, read character by character, once): the
top-level ``"name"``, once its string is complete (sent once, with an id and the type, in the
first delta of its index; indexes in the order the names come), and the raw text of the
``"arguments"`` value, sent as the model writes it: what a delta adds to the value, never a
character past its end (characters that may begin ``</tool_call>`` wait for the next delta).
The arguments' concatenation is therefore the model's JSON text, which parses to the value
the unstreamed answer (``json.dumps`` of it) parses to; a call cut short has sent a prefix of
it.  Like 0.6.3's parser, ``</tool_call>`` ends a call wherever it stands.

Standard library only.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

from .tool_args import call_id

START, END = "<tool_call>", "</tool_call>"
WS = " \t\n\r"


def _string(raw: str) -> Optional[str]:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class Call:
    """One call's JSON object (the text after ``<tool_call>``), read as it grows: its name
    once complete, where its ``"arguments"`` value starts and (once known) ends."""

    __slots__ = ("text", "pos", "phase", "key", "mark", "kind", "depth", "in_str", "esc",
                 "name", "args_start", "args_end")

    def __init__(self) -> None:
        self.text, self.pos, self.phase = "", 0, "open"
        self.key: Optional[str] = None
        self.mark, self.kind, self.depth, self.in_str, self.esc = 0, "", 0, False, False
        self.name: Optional[str] = None
        self.args_start: Optional[int] = None
        self.args_end: Optional[int] = None

    def feed(self, more: str) -> None:
        self.text += more
        text, i = self.text, self.pos
        while i < len(text) and self.phase not in ("done", "bad"):
            c, phase = text[i], self.phase
            if phase == "value" and c not in WS:
                self._value_starts(c, i)
            elif phase == "in_value":
                end = self._value_char(c, i)
                if end is not None:
                    self._value_ends(end)
                    if self.kind == "scalar":
                        continue  # the character after a number or literal: read it again
            elif phase == "in_key":
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.key, self.phase = _string(text[self.mark:i + 1]), "colon"
            elif c not in WS:
                expected = {"open": "{", "key": '"}', "colon": ":", "after": ",}"}
                if phase not in expected or c not in expected[phase]:
                    self.phase = "bad"
                elif c == '"':
                    self.phase, self.mark, self.esc = "in_key", i, False
                else:
                    self.phase = {"{": "key", ":": "value", ",": "key", "}": "done"}[c]
            i += 1
        self.pos = i

    def _value_starts(self, c: str, i: int) -> None:
        self.mark, self.phase, self.in_str, self.esc = i, "in_value", c == '"', False
        self.kind = "container" if c in "{[" else "string" if c == '"' else "scalar"
        self.depth = 1 if c in "{[" else 0
        if self.key == "arguments" and self.args_start is None:
            self.args_start = i

    def _value_char(self, c: str, i: int) -> Optional[int]:
        """Where the value ends when ``c`` (after its first character) ends it (exclusive),
        else None."""
        if self.kind == "scalar":
            return i if c in ",}] \t\n\r" else None
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
                if self.kind == "string":
                    return i + 1
            return None
        if c == '"':
            self.in_str = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 0:
                return i + 1
        return None

    def _value_ends(self, end: int) -> None:
        if self.key == "name" and self.name is None:
            self.name = _string(self.text[self.mark:end])
        if self.key == "arguments" and self.args_start == self.mark and self.args_end is None:
            self.args_end = end
        self.phase = "after"

    def close(self) -> None:
        """The call's text is complete (``</tool_call>``): a number or literal at its end
        ends there."""
        if self.phase == "in_value" and self.kind == "scalar":
            self._value_ends(len(self.text))

    def arguments(self) -> str:
        """The arguments' text read so far (all of it once the value ended)."""
        if self.args_start is None:
            return ""
        return self.text[self.args_start:len(self.text) if self.args_end is None
                         else self.args_end]


def _held_back(text: str, start: int) -> int:
    """How many characters at the end of ``text[start:]`` may begin ``</tool_call>``."""
    for n in range(min(len(END) - 1, len(text) - start), 0, -1):
        if text.endswith(END[:n]):
            return n
    return 0


class Entry:
    """A call of the stream: its reading, its index once named, what was sent of it."""

    __slots__ = ("call", "index", "sent", "slot", "parsed")

    def __init__(self) -> None:
        self.call = Call()
        self.index: Optional[int] = None
        self.sent = 0
        self.slot: Optional[int] = None  # its place in the parser's lists
        self.parsed = False


class Stream:
    """One choice's text, read as it grows (``feed``: the content and the tool call deltas a
    delta adds)."""

    __slots__ = ("text", "pos", "sent", "floor", "open", "calls", "named")

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0      # what was read
        self.sent = 0     # the end of the content sent (or dropped: whitespace between calls)
        self.floor = 0    # where the text after the last call starts
        self.open: Optional[Entry] = None
        self.calls: List[Entry] = []
        self.named = 0

    def feed(self, delta: str) -> Tuple[str, List[Tuple[Entry, Dict[str, Any]]]]:
        self.text += delta
        text = self.text
        content: List[str] = []
        touched: List[Entry] = []
        while True:
            entry = self.open
            if entry is None:
                at = text.find(START, max(self.pos - len(START) + 1, self.floor))
                end = len(text) if at == -1 else at
                piece = text[self.sent:end]
                if piece and (not self.calls or piece.strip(WS)):
                    content.append(piece)
                    self.sent = end
                if at == -1:
                    self.pos = len(text)
                    break
                self.open = Entry()
                self.calls.append(self.open)
                self.pos = self.sent = at + len(START)
                continue
            at = text.find(END, self.pos)
            stop = at if at != -1 else len(text) - _held_back(text, self.pos)
            entry.call.feed(text[self.pos:stop])
            self.pos = stop
            if entry not in touched:
                touched.append(entry)
            if at == -1:
                break
            entry.call.close()
            self.open = None
            self.pos = self.sent = self.floor = at + len(END)
        out = []
        for entry in touched:
            delta_call = self._delta(entry)
            if delta_call is not None:
                out.append((entry, delta_call))
        return "".join(content), out

    def _delta(self, entry: Entry) -> Optional[Dict[str, Any]]:
        first = entry.index is None
        if first:
            if entry.call.name is None:
                return None
            entry.index, self.named = self.named, self.named + 1
        arguments = entry.call.arguments()
        new, entry.sent = arguments[entry.sent:], len(arguments)
        if not first and not new:
            return None
        function = {"name": entry.call.name} if first else {}
        if new:
            function["arguments"] = new
        out: Dict[str, Any] = {"index": entry.index, "function": function}
        if first:
            out.update(id=call_id(), type="function")
        return out


__all__: List[str] = ["Call", "Entry", "Stream", "START", "END"]
