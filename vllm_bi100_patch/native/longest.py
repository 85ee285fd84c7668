"""The longest sequence of a decode call, without device synchronisations that matter.

``max_seq_len`` alone decides whether V1 may run (V1 sizes its shared memory from it; a longer
sequence overruns it and hangs BI-V100), so ``verify_bound`` checks it against ``seq_lens``
where that is free; ``longest`` gives the ``fallback_above`` rule the actual longest sequence.
The actual longest sequence is read only when it is free (CPU tensors) or needed
(``fallback_above``, eager mode, ``max_seq_len`` above the threshold), once per ``seq_lens``
tensor version, and never during CUDA-graph capture.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Optional

import torch

from .scratch import capturing

__all__ = ["longest", "verify_bound"]

#: The longest sequence read for the last ``seq_lens`` tensor (its identity and version).
_longest_cache: Dict[str, Any] = {"ref": None, "version": -1, "value": 0}


def verify_bound(seq_lens: torch.Tensor, max_seq_len: int) -> None:
    """``max_seq_len`` must bound every sequence: it alone decides whether V1 may run.

    Checked where it is free: CPU ``seq_lens`` (read once per tensor version), or a device
    ``seq_lens`` whose longest value this step already read (``fallback_above``).  Otherwise
    it is trusted, as vLLM computes it from the same lengths on the host
    (docs/bi100-limits.md, "max_seq_len"): reading a device tensor here would be a host sync
    per step, and impossible during CUDA-graph capture."""
    known = _known_longest(seq_lens)
    if known is not None and known > max_seq_len:
        raise ValueError(f"max_seq_len={max_seq_len} is below the longest sequence in "
                         f"seq_lens ({known}): it must bound every sequence (V1 sizes its "
                         "shared memory from it)")


def _read_longest(seq_lens: torch.Tensor) -> int:
    """The one device synchronisation of the routing (tests replace it to count calls)."""
    return int(seq_lens.max().item()) if seq_lens.numel() else 0


def _known_longest(seq_lens: torch.Tensor) -> Optional[int]:
    """The longest sequence when it costs no device sync: read from CPU ``seq_lens`` (once
    per tensor version), or the value already read for this device tensor's version."""
    ref = _longest_cache["ref"]
    if ref is not None and ref() is seq_lens and _longest_cache["version"] == seq_lens._version:
        return int(_longest_cache["value"])
    if seq_lens.device.type != "cpu":
        return None
    value = int(seq_lens.max()) if seq_lens.numel() else 0
    _longest_cache.update(ref=weakref.ref(seq_lens), version=seq_lens._version, value=value)
    return value


def longest(seq_lens: torch.Tensor, max_seq_len: int, threshold: int) -> int:
    """Longest sequence for the ``fallback_above`` test, or ``max_seq_len`` as its bound:
    no read when the bound is within the threshold, none during capture, else one sync per
    ``seq_lens`` version, shared by all layers of a step."""
    if max_seq_len <= threshold:
        return max_seq_len
    known = _known_longest(seq_lens)
    if known is not None:
        return known
    if capturing():
        return max_seq_len
    value = _read_longest(seq_lens)
    _longest_cache.update(ref=weakref.ref(seq_lens), version=seq_lens._version, value=value)
    return value
