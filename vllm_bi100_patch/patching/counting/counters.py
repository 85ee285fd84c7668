"""Every counter of this process, by name: the one registry.

A counter is registered once, by name, and then added to through its handle (``Counter``), so
no call path ever looks a name up (a name nobody registered cannot be counted, and fails where
it is registered, not in a server's decode).  Two groups, listed in this order by ``snapshot``:

- ``calls``: the patched methods' calls, as the patch table's rows declare them
  (``patch_row.Patch.counters``; registered by ``patching/factories.py``);
- ``routes``: the native decoder's routes (``decode_native_v1``, ``decode_native_v2``,
  ``decode_fallback``; registered by ``native/decoder.py``).

``snapshot()`` is what ``status()["counts"]``, the at-exit log line and any exporter read.
Stdlib only; one lock for all of them (a count is one locked add).
"""

from __future__ import annotations

import threading
from typing import Dict, Tuple

__all__ = ["GROUPS", "Counter", "register", "reset", "snapshot"]

#: The groups, in the order ``snapshot`` lists them.
GROUPS: Tuple[str, ...] = ("calls", "routes")

_lock = threading.Lock()
_groups: Dict[str, Dict[str, "Counter"]] = {group: {} for group in GROUPS}


class Counter:
    """One named counter of this process."""

    __slots__ = ("name", "group", "value")

    def __init__(self, name: str, group: str) -> None:
        self.name, self.group, self.value = name, group, 0

    def add(self, n: int = 1) -> None:
        with _lock:
            self.value += n

    def __repr__(self) -> str:
        return f"Counter({self.name!r}, {self.value})"


def register(name: str, group: str = "calls") -> Counter:
    """The counter ``name`` of ``group``, registered on first use (the same handle after)."""
    with _lock:
        counters = _groups[group]
        counter = counters.get(name)
        if counter is None:
            counter = counters[name] = Counter(name, group)
        return counter


def snapshot(group: str = "") -> Dict[str, int]:
    """Every registered counter (of ``group`` only, when given) by name, read under one lock:
    the calls first, then the routes, each in registration order."""
    with _lock:
        return {name: c.value for g in GROUPS if not group or g == group
                for name, c in _groups[g].items()}


def reset(group: str = "") -> None:
    """Zero every counter (of ``group`` only, when given)."""
    with _lock:
        for g in GROUPS:
            if not group or g == group:
                for counter in _groups[g].values():
                    counter.value = 0
