"""A body refused by name: ``RequestRefused`` (a ``ValueError``: pydantic turns it into the
400 vLLM's validation handler answers, naming what the client sent) and ``shown`` (a client's
value as log-safe text).  Every serving module that refuses a body or names a client's value
imports them from here (``request_body``, ``chat_compat``, ``tool_choice``, ``tool_args``,
``client_schema``).  Stdlib only.
"""

from __future__ import annotations

from typing import Any


class RequestRefused(ValueError):
    """A body the server cannot serve as asked (pydantic turns it into a 400 naming it)."""


#: The longest text of a client's value a message or a log line shows (``shown``).
SHOWN_CHARS = 80


def shown(value: Any) -> str:
    """``value`` as a log-safe text: ``ascii()`` (quotes, escapes every newline and non-ASCII
    character), cut to ``SHOWN_CHARS``."""
    text = ascii(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."
