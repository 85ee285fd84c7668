"""``Uncomputed``: run a kernel for its account only, without its arithmetic.

A ``TorchDispatchMode`` that runs each op on meta tensors first (shapes, strides and dtypes
only); an op with a large floating-point output (more than ``SMALL`` elements) returns zeros
of the meta result's layout instead (an in-place op returns its operand untouched), every
other op (indices, lengths, masks, small results) runs for real.  Zeros are finite and in
range: a kernel's range checks take their ordinary path, as they do on ordinary inputs (the
inputs should be zeros too).  Enter it *before* ``Account`` (``with Uncomputed(), Account() as acc:``): the
account is the innermost mode and counts the original ops with their operands, so its
launches, bytes and FLOPs are the same as a real run's wherever the kernel's control flow
depends only on shapes and small integer tensors (the GPU formulation of the shim's kernels,
the field's PyTorch fallbacks; ``tests/scripts/test_calibrate_model.py`` compares both at a
small shape).  It makes a 235K-token prefix chunk countable in a second on a CPU.  Values are
garbage: never use the outputs.  For the account only: not part of the package.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["SMALL", "Uncomputed"]

#: Outputs of at most this many elements are computed for real.
SMALL = 1 << 16


def _meta(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return t


def _numel(out: Any) -> int:
    """Elements of the floating-point outputs (integer and boolean outputs are indices,
    lengths and masks a kernel may read: always computed)."""
    tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if any(not (t.is_floating_point() or t.is_complex()) for t in tensors):
        return 0
    return sum(t.numel() for t in tensors)


class Uncomputed(TorchDispatchMode):
    """Ops with large floating-point outputs are not computed (the module's docstring)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "is_view", False):
            return func(*args, **kwargs)
        try:
            meta_out = func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
        except Exception:  # no meta kernel, or data-dependent: compute it
            return func(*args, **kwargs)
        if _numel(meta_out) <= SMALL:
            return func(*args, **kwargs)
        schema = func._schema
        mutated = [a for a, arg in zip(args, schema.arguments)
                   if arg.alias_info is not None and arg.alias_info.is_write]
        mutated += [kwargs[arg.name] for arg in schema.arguments
                    if arg.kwarg_only and arg.name in kwargs and arg.alias_info is not None
                    and arg.alias_info.is_write]
        if mutated:  # in place, or out=: the operand itself, untouched
            return mutated[0] if len(mutated) == 1 else tuple(mutated)
        device = next((t.device for t in tree_flatten((args, kwargs))[0]
                       if isinstance(t, torch.Tensor) and t.device.type != "meta"),
                      torch.device("cpu"))
        return tree_map(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                      device=device).zero_()
                        if isinstance(t, torch.Tensor) else t, meta_out)
