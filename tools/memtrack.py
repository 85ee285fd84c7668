"""Peak bytes of tensors allocated inside a block of code, on any device.

torch has no allocator statistics for CPU, and tracemalloc does not see torch's
allocations, so this counts tensor storages instead: a ``TorchDispatchMode`` sees every
aten op's outputs, records each new storage's size, and a weakref finalizer subtracts it
when the storage dies.  The peak of the running sum is the peak extra memory of the code
(storages created outside the block, such as the inputs, are not counted).  Used by the
kernel tests and the benchmark (not part of the package: it imports a private torch
module); it slows the code down, so never time under it.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Optional, Set

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["PeakMemory"]


class PeakMemory(TorchDispatchMode):
    """``with PeakMemory() as mem: ...`` then ``mem.peak_bytes`` / ``mem.live_bytes``."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._seen: Set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        if key in self._seen:
            self._seen.discard(key)
            self.live_bytes -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            key = storage.data_ptr()
            if nbytes == 0 or key in self._seen or any(
                    _same_storage(a, storage) for a in tree_flatten((args, kwargs))[0]):
                continue
            self._seen.add(key)
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            weakref.finalize(storage, self._release, key, nbytes)
        return out


def _same_storage(arg: Any, storage: torch.UntypedStorage) -> bool:
    """Whether ``arg`` is a tensor on ``storage`` (in-place ops and views allocate nothing)."""
    return (isinstance(arg, torch.Tensor) and arg.device.type != "meta"
            and arg.untyped_storage().data_ptr() == storage.data_ptr())
