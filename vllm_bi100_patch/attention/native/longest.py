"""The longest sequence of a decode call, without device synchronisations that matter.

``max_seq_len`` alone decides whether V1 may run (V1 sizes its shared memory from it; a longer
sequence overruns it and hangs BI-V100), so ``verify_bound`` checks it against ``seq_lens``
wherever that costs no device sync, and ``longest`` gives the ``fallback_above`` rule the
actual longest sequence.

- CPU ``seq_lens``: read at every call (about 1-5 microseconds), never from a cache: a cached
  value could not see a write that does not bump the tensor's version (``t.numpy()[:] = ...``),
  and the check would then admit a lie.
- Device ``seq_lens``: read only where the ``fallback_above`` rule needs it (eager mode,
  ``max_seq_len`` above the threshold), once per tensor version, and never during CUDA-graph
  capture; ``verify_bound`` then checks against that reading.  Otherwise a device bound is
  trusted, as vLLM computes it from the same lengths on the host (docs/bi100-limits.md,
  "max_seq_len"): the check of a device bound can only refuse one, never admit one it would
  refuse without the reading.

The one device reading kept is one immutable tuple, replaced whole, taken with the tensor's
version from before the read: threads never see half of another call's reading, and a write
during the read leaves a reading that no later version matches.
"""

from __future__ import annotations

import weakref
from typing import Optional, Tuple

import torch

from .scratch import capturing

__all__ = ["forget", "longest", "verify_bound"]

#: (the device ``seq_lens``, its version before it was read, its longest sequence).
_device_read: Optional[Tuple["weakref.ref[torch.Tensor]", int, int]] = None


def verify_bound(seq_lens: torch.Tensor, max_seq_len: int) -> Optional[int]:
    """The longest sequence where it is known without a device sync (None otherwise), after
    checking that ``max_seq_len`` bounds it: ValueError if it does not."""
    known = _cpu_longest(seq_lens) if seq_lens.device.type == "cpu" else _read_already(seq_lens)
    if known is not None and known > max_seq_len:
        raise ValueError(f"max_seq_len={max_seq_len} is below the longest sequence in "
                         f"seq_lens ({known}): it must bound every sequence (V1 sizes its "
                         "shared memory from it)")
    return known


def _cpu_longest(seq_lens: torch.Tensor) -> int:
    """The longest sequence of a CPU ``seq_lens``, read now: through a Python list up to 32
    sequences (under a microsecond for a few; ``max()``'s dispatch costs about 5), else
    ``max()``."""
    n = seq_lens.numel()
    if n <= 32:
        return max(seq_lens.tolist()) if n else 0
    return int(seq_lens.max())


def _read_already(seq_lens: torch.Tensor) -> Optional[int]:
    """The reading of this device tensor at its current version, if one was taken."""
    entry = _device_read  # one read of the global: a whole tuple, never half of two
    if entry is None:
        return None
    reader, version, value = entry
    return value if version == seq_lens._version and reader() is seq_lens else None


def _read_longest(seq_lens: torch.Tensor) -> int:
    """The one device synchronisation of the routing (tests replace it to count calls)."""
    return int(seq_lens.max().item()) if seq_lens.numel() else 0


def longest(seq_lens: torch.Tensor, max_seq_len: int, threshold: int,
            known: Optional[int]) -> int:
    """Longest sequence for the ``fallback_above`` test, or ``max_seq_len`` as its bound:
    ``known`` (``verify_bound``'s) when there is one; no read when the bound is within the
    threshold, none during capture, else one sync per device tensor version, shared by all
    layers of a step."""
    global _device_read
    if max_seq_len <= threshold:
        return max_seq_len
    if known is not None:
        return known
    if capturing():
        return max_seq_len
    version = seq_lens._version  # before the read: a write during it leaves no match
    value = _read_longest(seq_lens)
    _device_read = (weakref.ref(seq_lens), version, value)
    return value


def forget() -> None:
    """Drop the device reading (tests)."""
    global _device_read
    _device_read = None
