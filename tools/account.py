"""The device-independent account of one kernel call (launches, bytes moved, FLOPs): its
home is ``vllm_bi100_patch.ops.selftest.account`` (``selftest`` prints it with every timing);
re-exported here for the benchmark, the profiler comparison and the kernel budget tests, with
the benchmark's ``HalfGemmsInFloat`` (CPU half-precision products in float32, for speed)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from vllm_bi100_patch.ops.selftest.account import (DEVICES, FREE_OPS, Account, DeviceModel, Launch,
                                               predict)

__all__ = ["Account", "DEVICES", "DeviceModel", "FREE_OPS", "HalfGemmsInFloat", "Launch",
           "predict"]

_GEMMS = {"mm", "bmm", "addmm", "baddbmm", "addbmm"}
_HALF = (torch.float16, torch.bfloat16)


class HalfGemmsInFloat(TorchDispatchMode):
    """CPU half-precision matrix products computed in float32 and rounded back (what a GPU
    GEMM with float32 accumulation does), for an account's speed only (CPUs without float16
    matrix instructions emulate them about 100 times slower than float32).  Enter it
    *before* ``Account`` (``with HalfGemmsInFloat(), Account() as acc:``): the account is
    then the innermost mode, sees and logs the original op with its operands, and its
    counts are the same as without this mode."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if (name.rstrip("_") not in _GEMMS or first is None or first.device.type != "cpu"
                or not any(isinstance(a, torch.Tensor) and a.dtype in _HALF for a in args)):
            return func(*args, **kwargs)
        target = kwargs.pop("out", None)
        if target is None and name.endswith("_"):
            target = first
        dtype = first.dtype if target is None else target.dtype
        up = tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in _HALF
                      else t, (args, kwargs))
        result = getattr(torch.ops.aten, name.rstrip("_")).default(*up[0], **up[1])
        if target is None:
            return result.to(dtype)
        return target.copy_(result)
