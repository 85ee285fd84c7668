"""The kernels' formulation overrides: one context manager, ``forced``, and its state.

By default the kernels choose their formulation from the device and the call: the compute
mode (``compute.compute_mode``: ``"fp32"`` on CPU, ``"native"`` elsewhere), the tile layout
(``compute.fast_layout``: ``"fast"`` on CPU, ``"generic"`` elsewhere) and the prompt path of
each query row (``prefill._attend``: SDPA where allowed and within the budget, else
``"tiled"``).  Tests, the selftest and the benchmarks run a device's formulation on another
device by forcing them::

    with forced(compute="native", layout="generic", path="tiled"):
        paged_decode(...)

An argument left out keeps the state it finds; ``None`` restores the choice by device.  On exit
(an exception included) the state it found comes back, so blocks nest.

The state is one process-wide value (not a context variable): vLLM calls the kernels from its
executor threads (the async engine runs the model in a thread pool, which copies no context),
and a test that forces a formulation around an engine must reach those calls.  So a block
forces every thread's calls while it is open; blocks are meant for one driver at a time (tests,
the selftest, scripts), not for concurrent, differing forcings.  Reading it is one function
call and one attribute per kernel call.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, Iterator, Optional

__all__ = ["Forcing", "forced", "forcing"]

#: The values each override accepts (``None``: choose by device, or by budget for ``path``).
CHOICES: Dict[str, tuple] = {"compute": (None, "fp32", "native"),
                             "layout": (None, "fast", "generic"),
                             "path": (None, "sdpa", "tiled")}


@dataclasses.dataclass(frozen=True)
class Forcing:
    """The overrides in force: ``compute`` (``"fp32"``/``"native"``), ``layout``
    (``"fast"``/``"generic"``), ``path`` (``"sdpa"``/``"tiled"``); ``None`` chooses."""

    compute: Optional[str] = None
    layout: Optional[str] = None
    path: Optional[str] = None


_KEEP: Any = object()  # an argument left out of ``forced``

_state = Forcing()


def forcing() -> Forcing:
    """The overrides in force now (the kernels read it on every call)."""
    return _state


@contextlib.contextmanager
def forced(*, compute: Optional[str] = _KEEP, layout: Optional[str] = _KEEP,
           path: Optional[str] = _KEEP) -> Iterator[Forcing]:
    """Force the given parts of the formulation while inside; yields the overrides in force."""
    global _state
    changes = {name: value for name, value in
               (("compute", compute), ("layout", layout), ("path", path)) if value is not _KEEP}
    for name, value in changes.items():
        if value not in CHOICES[name]:
            raise ValueError(f"forced({name}={value!r}): expected one of {CHOICES[name]}")
    saved = _state
    _state = dataclasses.replace(saved, **changes)
    try:
        yield _state
    finally:
        _state = saved
