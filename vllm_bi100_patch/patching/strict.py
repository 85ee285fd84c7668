"""Strict mode's one rule: a problem raises under strict mode, else it is logged (once).

Every site that meets a problem the operator must know of (an invalid variable, an unsupported
vLLM, a failed code check, a failed patch or activation) calls ``raise_or_log``; nothing else
decides between raising and logging.  Cheap at import (the bootstrap imports it at interpreter
start): stdlib only, and ``logging`` only once something is logged.
"""

from __future__ import annotations

import _thread

from ..activation.log import log

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Iterable, Optional


class PatchError(RuntimeError):
    """Raised under strict mode when the shim cannot patch (unsupported version, failed check)."""


_lock = _thread.RLock()
#: The reasons already warned of in this process (``warn_once``).
_warned: set = set()


def warn_once(reason: str) -> None:
    """One WARNING line per reason per process, whichever activation path meets it first."""
    with _lock:
        if reason in _warned:
            return
        _warned.add(reason)
    log.warning("vllm-bi100-patch: %s", reason)


def raise_or_log(reason: str, strict: bool, *, error: type = PatchError,
                 exc: Optional[BaseException] = None, traceback: bool = False,
                 warnings: Optional[Iterable[str]] = None) -> None:
    """Under ``strict``: raise ``exc`` when given (the failure itself), else ``error(reason)``.
    Otherwise log and return: a caught ``exc`` as one ERROR line saying ``reason`` (with the
    traceback if ``traceback``), any other problem as a WARNING once per process (each of
    ``warnings`` when given, else ``reason``). Logging itself never raises here."""
    if strict:
        if exc is not None:
            raise exc
        raise error(reason)
    try:
        if exc is not None:
            log.error("vllm-bi100-patch: %s", reason, exc_info=exc if traceback else None)
            return
        for line in (warnings if warnings is not None else [reason]):
            warn_once(line)
    except Exception:  # a broken logging configuration must not stop the host
        pass
