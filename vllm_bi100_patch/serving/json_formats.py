"""The string formats OpenAI's strict mode lists, checked (for the strict check of
``tool_args``; docs/serving-compat.md, "Tool calls").

OpenAI's structured outputs accept ``format`` values ``date-time``, ``time``, ``date``,
``duration``, ``email``, ``hostname``, ``ipv4``, ``ipv6`` and ``uuid`` (platform.openai.com,
"Structured model outputs", supported properties).  jsonschema treats ``format`` as an
annotation unless a format checker is given, and its checkers for date-time, time, duration and
hostname need optional packages a vLLM install does not bring; so each is checked here, in plain
Python, by its definition:

- ``date``, ``time``, ``date-time``: RFC 3339 section 5.6 (``full-date``, ``full-time`` with its
  offset, ``date-time``; a leap second allowed, the calendar checked);
- ``duration``: RFC 3339 Appendix A (ISO 8601 durations: ``P1Y2M``, ``PT30S``, ``P2W``);
- ``email``: RFC 5321 section 4.1.2 ``Mailbox`` (a dot-atom or quoted local part, a host name
  or an address literal);
- ``hostname``: RFC 1123 section 2.1 (labels of letters, digits and hyphens, 63 characters
  each, 253 in all);
- ``ipv4``, ``ipv6``: Python's ``ipaddress`` (no leading zeros, no IPv6 zone);
- ``uuid``: RFC 4122 section 3 (8-4-4-4-12 hexadecimal digits).

Every pattern here is the module's own, linear in the text (no client pattern is ever run by
Python's ``re``).  ``check(fmt, value)``: True or False for a known format, None for any other
(not checked: the caller says so).  Stdlib only.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
from typing import Any, Callable, Dict, List, Optional

#: The formats checked here (the ones OpenAI's strict mode lists).
FORMATS = ("date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid")

_DATE = re.compile(r"(\d{4})-(\d{2})-(\d{2})\Z", re.ASCII)
_TIME = re.compile(r"(\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-](\d{2}):(\d{2}))\Z", re.ASCII)
_DUR_DATE = r"(?:\d+Y(?:\d+M(?:\d+D)?)?|\d+M(?:\d+D)?|\d+D)"
_DUR_TIME = r"T(?:\d+H(?:\d+M(?:\d+S)?)?|\d+M(?:\d+S)?|\d+S)"
_DURATION = re.compile(rf"P(?:\d+W|{_DUR_DATE}(?:{_DUR_TIME})?|{_DUR_TIME})\Z", re.ASCII)
_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_LOCAL = re.compile(rf'(?:{_ATOM}(?:\.{_ATOM})*|"(?:[^"\\\x00-\x1f]|\\.)*")\Z', re.ASCII)
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\Z", re.ASCII)
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                   r"[0-9a-fA-F]{12}\Z", re.ASCII)


def date(text: str) -> bool:
    m = _DATE.match(text)
    if m is None:
        return False
    try:
        datetime.date(int(m[1]), int(m[2]), int(m[3]))
    except ValueError:
        return False
    return True


def time(text: str) -> bool:
    m = _TIME.match(text)
    if m is None:
        return False
    hour, minute, second = int(m[1]), int(m[2]), int(m[3])
    if hour > 23 or minute > 59 or second > 60:  # 60: a leap second
        return False
    return m[6] is None or (int(m[6]) <= 23 and int(m[7]) <= 59)


def date_time(text: str) -> bool:
    if len(text) < 11 or text[10] not in "Tt":
        return False
    return date(text[:10]) and time(text[11:])


def duration(text: str) -> bool:
    return _DURATION.match(text) is not None


def hostname(text: str) -> bool:
    name = text[:-1] if text.endswith(".") else text
    if not name or len(name) > 253:
        return False
    return all(_LABEL.match(label) is not None for label in name.split("."))


def ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


def ipv6(text: str) -> bool:
    if "%" in text:
        return False  # a zone (scope) is no address
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def email(text: str) -> bool:
    local, at, domain = text.rpartition("@")
    if not at or not local or len(local) > 64 or _LOCAL.match(local) is None:
        return False
    if domain.startswith("[") and domain.endswith("]"):
        literal = domain[1:-1]
        return ipv6(literal[5:]) if literal[:5].lower() == "ipv6:" else ipv4(literal)
    return hostname(domain)


def uuid(text: str) -> bool:
    return _UUID.match(text) is not None


CHECKS: Dict[str, Callable[[str], bool]] = {
    "date-time": date_time, "time": time, "date": date, "duration": duration, "email": email,
    "hostname": hostname, "ipv4": ipv4, "ipv6": ipv6, "uuid": uuid,
}


def check(fmt: Any, value: Any) -> Optional[bool]:
    """Whether ``value`` has format ``fmt`` (a value that is no string has every format);
    None: ``fmt`` is not one checked here."""
    checker = CHECKS.get(fmt) if isinstance(fmt, str) else None
    if checker is None:
        return None
    return True if not isinstance(value, str) else checker(value)


__all__: List[str] = ["CHECKS", "FORMATS", "check"]
