"""The build's native V1 decode kernel, for the selftest: found the way the shim finds it,
called only within its limit.

``find`` imports ``vllm._custom_ops`` (only where vLLM is installed, behind the shim's import
guard, so vLLM's Triton prefix kernel stays out of the process), probes it as the patch layer
does (``native.compiled_kernels_missing``, ``OpsProfile``) and takes the V1 limit and the
route table of the shim's own routing (``native.settings.routing_for``: the
``VLLM_BI100_*`` settings, the Iluvatar limit of 32,768 tokens).  ``NativeV1.call`` refuses a
call above that limit (``HazardRefused``) before any kernel sees it: on a BI-V100 V1 hangs
there.  V2 is never called (CoreX 3.2.3's is a stub; ixformer's own gave wrong results).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, List, Optional, Tuple

import torch

from ...activation import config
from ...patching import hardware
from ...attention.native import NATIVE_HEAD_SIZES, DecodeCall, RouteTable, compiled_kernels_missing
from ...attention.native.decoder import head_mapping_for
from ...attention.native.probe import KernelProfile, OpsProfile
from .checks import Skip
from .reference import TOLERANCE, decode_inputs, ref_decode, rel_error

__all__ = ["HazardRefused", "NativeV1", "find", "native_checks"]


class HazardRefused(RuntimeError):
    """The selftest was about to run something that hangs or breaks the card: not run."""


class NativeV1:
    """The V1 kernel of this build, its limit and the shim's route table over the same ops."""

    def __init__(self, table: RouteTable, kernel: KernelProfile) -> None:
        self.table, self.kernel = table, kernel
        self.limit = table.v1_limit
        self.calls: List[int] = []  # the max_seq_len of every call made (the tests read it)

    @property
    def build(self) -> str:
        return self.table.profile.build if self.table.profile is not None else "stock"

    def decode_call(self, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, max_seq_len: int, scale: float) -> DecodeCall:
        return DecodeCall.checked(query, key_cache, value_cache, block_tables, seq_lens,
                                  max_seq_len, "auto", int(key_cache.shape[1]), scale, None,
                                  1.0, 1.0, None, 0, (0, 0, 64, 0))

    def route(self, call: DecodeCall) -> str:
        """The route the shim's decoder takes for ``call`` (nothing is run)."""
        return self.table.route(call)[0]

    def call(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
             scale: float) -> torch.Tensor:
        """V1's output; ``HazardRefused`` above the limit (no kernel is called)."""
        if max_seq_len > self.limit:
            raise HazardRefused(f"native V1 with max_seq_len={max_seq_len} > its limit "
                                f"{self.limit}: not run (it hangs a BI-V100)")
        c = self.decode_call(query, key_cache, value_cache, block_tables, seq_lens,
                             max_seq_len, scale)
        out = torch.empty_like(query)
        k = self.kernel
        assert k.convention is not None and k.func is not None
        mapping = head_mapping_for(c) if k.takes_head_mapping else None
        self.calls.append(max_seq_len)
        k.convention.invoke(k.func, k.nargs, c, out, None, mapping)
        return out


def find(device: torch.device, head_size: int, enabled: bool = True
         ) -> Tuple[Optional[NativeV1], str]:
    """The native V1 of this build for ``head_size`` on ``device``, or None and why not."""
    if not enabled:
        return None, "not looked for (--no-native)"
    if head_size not in NATIVE_HEAD_SIZES:
        return None, f"head size {head_size} has no native kernel ({list(NATIVE_HEAD_SIZES)})"
    ixformer = hardware.ixformer_present()
    if device.type == "cpu" and not ixformer:
        return None, "CPU without ixformer: no native kernels to time"
    if not hardware.findable("vllm"):
        return None, "vLLM is not installed"
    from ...attention import import_guard
    from ...attention.native.settings import routing_for

    settings = config.load()
    if not settings.kill_switch:
        import_guard.install()  # vLLM's Triton prefix kernel never enters this process
    try:
        import vllm._custom_ops as ops  # noqa: F401 (vLLM, present: imported on purpose)
    except Exception as exc:  # a broken install: report it, time the fallback only
        return None, f"vllm._custom_ops does not import: {type(exc).__name__}: {exc}"
    ops = sys.modules["vllm._custom_ops"]
    missing = compiled_kernels_missing(ops, ixformer)
    if missing is not None:
        return None, missing
    profile = OpsProfile(ops)
    if not profile.v1.present or profile.v1.convention is None:
        return None, f"paged_attention_v1 {profile.v1.describe()}"
    table = RouteTable(profile, routing_for(settings))
    return NativeV1(table, profile.v1), f"paged_attention_v1 {profile.v1.describe()}"


def native_checks(v1: Optional[NativeV1], dtype: torch.dtype, head_size: int
                  ) -> List[Callable[[torch.device], None]]:
    """The checks of the build's native V1 (they skip where there is none)."""

    def check_native_v1_matches_reference(device: torch.device) -> None:
        """Native V1 against the float64 reference (contexts 1 to 700, within its limit)."""
        if v1 is None:
            raise Skip("no native V1 in this build")
        q, kc, vc, bt, sl = decode_inputs(dtype, head_size, 1.0, 11, device)
        out = v1.call(q, kc, vc, bt, sl, 700, head_size ** -0.5)
        ref = ref_decode(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), sl.cpu(), head_size ** -0.5)
        err = rel_error(out.cpu(), ref)
        assert err <= TOLERANCE[("native", dtype)], ("native V1", err)

    def check_route_above_v1_limit(device: torch.device) -> None:
        """The shim's route table gives V1 a call at its limit and never one above it."""
        if v1 is None:
            raise Skip("no native V1 in this build")
        q, kc, vc, bt, sl = decode_inputs(dtype, head_size, 1.0, 12, device)
        at, above = (v1.route(v1.decode_call(q, kc, vc, bt, sl, n, 0.1))
                     for n in (v1.limit, v1.limit + 1))
        assert above != "native_v1", f"max_seq_len {v1.limit + 1} routed to V1"
        assert at in ("native_v1", "native_v2", "fallback"), at

    return [check_native_v1_matches_reference, check_route_above_v1_limit]


def describe(v1: Optional[NativeV1], why: str) -> Any:
    """What the selftest reports about the native kernels."""
    if v1 is None:
        return {"native_v1": None, "why": why}
    return {"native_v1": why, "v1_limit": v1.limit, "convention": v1.build,
            "routes": v1.table.describe()["bands"]}
