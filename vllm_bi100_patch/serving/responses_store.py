"""The output items ``/v1/responses`` answered, kept in memory so that a later request may
refer to them by id (``{"type": "item_reference", "id": "msg_..."}``): the Vercel AI SDK's
``@ai-sdk/openai`` sends the previous answer so in a multi-turn chat at its defaults (its
``store`` left unset, which OpenAI reads as true).

Bounded, and nothing survives a restart: at most ``MAX_ITEMS`` items and ``MAX_BYTES`` of their
JSON, each for ``MAX_AGE_S`` seconds; the oldest go first.  Items of a request sent with
``store: false`` are not kept.  An id is 128 random bits (``responses_answer.new_id``), known
only to the client it was answered to.  A lookup is one dictionary read: no request waits on
another's.  docs/operating.md, "The Responses API's item store".  Stdlib only.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from typing import Any, Dict, Iterable, Optional, Tuple

MAX_ITEMS = 10_000
MAX_BYTES = 64 * 1024 * 1024
MAX_AGE_S = 3600.0
#: The item types a reference may name (what this server answers).
TYPES = frozenset({"message", "function_call", "reasoning"})

_lock = threading.Lock()
#: id -> (time kept, size, item), oldest first.
_items: "collections.OrderedDict[str, Tuple[float, int, Dict[str, Any]]]" = \
    collections.OrderedDict()
_bytes = 0


def _expire(now: float) -> None:
    global _bytes
    while _items:
        key, (kept, size, _) = next(iter(_items.items()))
        if now - kept <= MAX_AGE_S and len(_items) <= MAX_ITEMS and _bytes <= MAX_BYTES:
            return
        del _items[key]
        _bytes -= size


def keep(items: Iterable[Dict[str, Any]], now: Optional[float] = None) -> None:
    """Keep ``items`` (a response's output) under their ids."""
    global _bytes
    now = time.monotonic() if now is None else now
    with _lock:
        for item in items:
            if item.get("type") not in TYPES or not isinstance(item.get("id"), str):
                continue
            text = json.dumps(item)
            if len(text) > MAX_BYTES:
                continue
            old = _items.pop(item["id"], None)
            if old is not None:
                _bytes -= old[1]
            _items[item["id"]] = (now, len(text), json.loads(text))
            _bytes += len(text)
        _expire(now)


def find(item_id: Any, now: Optional[float] = None) -> Optional[Dict[str, Any]]:
    """The item kept under ``item_id`` (a copy), or None."""
    if not isinstance(item_id, str):
        return None
    now = time.monotonic() if now is None else now
    with _lock:
        _expire(now)
        found = _items.get(item_id)
        return json.loads(json.dumps(found[2])) if found is not None else None


def size() -> Tuple[int, int]:
    """(items, bytes) kept now."""
    with _lock:
        return len(_items), _bytes


def clear() -> None:
    global _bytes
    with _lock:
        _items.clear()
        _bytes = 0


LIMITS = (f"items are kept in this server's memory for {int(MAX_AGE_S // 60)} minutes, at most "
          f"{MAX_ITEMS:,} items and {MAX_BYTES // (1024 * 1024)} MiB, never across restarts")

__all__ = ["LIMITS", "MAX_AGE_S", "MAX_BYTES", "MAX_ITEMS", "clear", "find", "keep", "size"]
