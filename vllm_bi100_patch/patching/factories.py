"""What every patch module shares: the wrapper and factory types, the argument reader and the
call counters.

- ``Wrapper``: what a row's factory returns, a wrapt wrapper ``(wrapped, instance, args,
  kwargs) -> result``; ``Factory``: the factory a row names (``patch_row.Patch.factory``), called
  once per patch as ``factory(family, original, module, settings)``.
- ``ArgReader``: reads one family's arguments (positional or keyword) into parameter order,
  cheaply, raising the ``TypeError`` Python would; given a counter, it counts each call it
  read.
- ``counter(name)``: the handle of a call counter that a row of the table declares
  (``patch_row.Patch.counters``); a name no row declares is refused when the module asks for it,
  at import, never in a call.  ``call_counts()`` is every counter of this process (the calls,
  then the decode routes: ``counters.snapshot()``).

Imported only by the patch modules (the patching layer, where vLLM and torch are loaded
already); never imports vLLM.
"""

from __future__ import annotations

import atexit
import inspect
import os
import types
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

from ..activation import config
from .counting import counters, metrics
from . import table
from ..activation.log import log
from .counting.counters import Counter
from .versions import Family

__all__ = ["ArgReader", "Counter", "Factory", "Wrapper", "call_counts", "counter", "log_counts",
           "reset_call_counts"]

#: A wrapt wrapper: ``(wrapped, instance, args, kwargs) -> result``.
Wrapper = Callable[[Callable[..., Any], Any, Tuple[Any, ...], Dict[str, Any]], Any]


class Factory(Protocol):
    """A row's factory (``patch_row.Patch.factory``): builds the wrapper of ``original``, the
    function found in ``module`` (vLLM's target module), for ``family`` under ``settings``."""

    def __call__(self, family: Family, original: Callable[..., Any], module: types.ModuleType,
                 settings: config.Settings) -> Wrapper: ...


#: Every counter name a row of the table declares.
DECLARED = frozenset(name for row in table.PATCHES for name in row.counters)


def counter(name: str) -> Counter:
    """The call counter ``name``, which a row of the table must declare in its ``counters``
    (registered on first use)."""
    if name not in DECLARED:
        raise ValueError(f"no row of vllm_bi100_patch.patching.table declares the counter {name!r}: add "
                         "it to that row's counters=(...)")
    return counters.register(name)


# status() has always listed, from the moment any patch module loads, the PagedAttention method
# counters first and the decode routes last (``decode_<route>``, the native decoder's counters,
# registered here by name so that no patch module needs the decoder loaded), and every other
# row's counters from the moment its module loads: kept as it was.
for _name in ("forward_decode", "forward_prefix", "swap_blocks", "copy_blocks"):
    counter(_name)
for _route in metrics.ROUTES:
    counters.register("decode_" + _route, "routes")


def call_counts() -> Dict[str, int]:
    """Every counter of this process by name: the calls of each patched method, then the
    decode routes taken (``decode_<route>``), read under one lock."""
    return counters.snapshot()


def reset_call_counts() -> None:
    """Zero the call counters, the decode route counters and the metrics' own tally (decode
    reasons and lengths, prefix paths, refusals: ``metrics.TALLY``)."""
    counters.reset()
    metrics.TALLY.reset()


def log_counts() -> None:
    """Log the call and route counters at INFO (at exit, and on request)."""
    counts = call_counts()
    if any(counts.values()):
        log.info("vllm-bi100-patch counters (pid %d): %s", os.getpid(),
                 ", ".join(f"{k}={v}" for k, v in counts.items()))


atexit.register(log_counts)


class ArgReader:
    """Reads one family's arguments (positional or keyword) into parameter order, cheaply;
    adds one to ``count`` (when given) for every call it read."""

    def __init__(self, params: Sequence[str], defaults: Mapping[str, Any], what: str,
                 count: Optional[Counter] = None) -> None:
        self.params = tuple(params)
        self.defaults = dict(defaults)
        self.what = what
        self.count = count
        self._names = frozenset(self.params)

    @classmethod
    def for_function(cls, func: Callable[..., Any], params: Sequence[str], what: str,
                     count: Optional[Counter] = None) -> "ArgReader":
        sig = inspect.signature(func)
        defaults = {n: p.default for n, p in sig.parameters.items()
                    if p.default is not inspect.Parameter.empty}
        return cls(params, defaults, what, count)

    def read(self, args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> List[Any]:
        if len(args) > len(self.params):
            raise TypeError(f"{self.what}() takes {len(self.params)} positional arguments "
                            f"but {len(args)} were given")
        values = list(args)
        for name in self.params[len(args):]:
            if name in kwargs:
                values.append(kwargs[name])
            elif name in self.defaults:
                values.append(self.defaults[name])
            else:
                raise TypeError(f"{self.what}() missing required argument: {name!r}")
        if kwargs:
            extra = set(kwargs) - self._names
            if extra:
                raise TypeError(f"{self.what}() got unexpected keyword arguments: "
                                f"{sorted(extra)}")
            dup = set(kwargs) & set(self.params[:len(args)])
            if dup:
                raise TypeError(f"{self.what}() got multiple values for {sorted(dup)}")
        if self.count is not None:
            self.count.add()
        return values
