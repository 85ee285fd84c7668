"""The BI-V100 model calibrated on the card's published measurements: what a counted call
(``account.Account``) should take on the card.

Per launch: a host cost ``launch_s`` plus, for its op class, ``bytes / bandwidth[class]``, and
for matrix products the larger of that and ``flops / flops_rate``.  Classes
(``op_class``): ``matmul`` (``mm``, ``bmm``, ``addmm``, ``baddbmm``, fused attention),
``gather`` (index ops, indexed writes and layout copies: ``index``, ``index_select``,
``gather``, ``scatter*``, ``copy_``, ``clone``, ``_to_copy``, ``cat``, ...), ``reduction``
(``amax``, ``max``, ``sum``, ``softmax``, ...) and ``elementwise`` (everything else).

The constants are ``fitted.CONSTANTS``, written by ``scripts/calibrate_model.py`` from the
field's PyTorch formulations replayed under the account at the shapes and lengths they were
measured (``docs/performance.md``, "The model calibrated on the card's measurements", with
every point, its fitted value and its residual, and where the fit is weak).  It is a model:
the selftest prints it beside its own measurements (``projected_ms``), never instead of them.
Needs torch only through the account it is given.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, Mapping

__all__ = ["CLASSES", "Calibrated", "load", "op_class"]

CLASSES = ("matmul", "gather", "elementwise", "reduction")

_MATMUL = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul",
           "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"}
_GATHER = {"index_select", "index", "gather", "embedding", "take", "index_copy_", "index_copy",
           "index_put_", "index_put", "_index_put_impl_", "scatter_", "scatter", "scatter_add_",
           "scatter_add", "index_add_", "index_add", "copy_", "clone", "_to_copy",
           "contiguous", "cat", "stack", "repeat", "repeat_interleave", "expand_copy",
           "permute_copy", "_unsafe_index", "masked_select", "index_fill_",
           "corex_paged_kv_gather"}
_REDUCTION = {"amax", "amin", "max", "min", "sum", "mean", "prod", "logsumexp", "_softmax",
              "softmax", "_log_softmax", "argmax", "argmin", "norm", "linalg_vector_norm",
              "cumsum", "var", "std", "any", "all"}


def op_class(name: str) -> str:
    """The class of an aten op (its overload packet's name, as ``Launch.name``)."""
    if name in _MATMUL:
        return "matmul"
    if name in _GATHER:
        return "gather"
    if name in _REDUCTION:
        return "reduction"
    return "elementwise"


@dataclasses.dataclass(frozen=True)
class Calibrated:
    """Host cost per launch (s), bandwidth per op class (bytes/s), matrix-product rate
    (FLOP/s); ``source``: where the constants come from."""

    launch_s: float
    bandwidth: Mapping[str, float]
    flops_rate: float
    source: str = ""

    def launch_seconds(self, name: str, nbytes: int, flops: int) -> float:
        cls = op_class(name)
        move = nbytes / self.bandwidth[cls]
        if cls == "matmul":
            move = max(move, flops / self.flops_rate)
        return self.launch_s + move

    def predict(self, launches: Iterable[Any]) -> float:
        """Modelled seconds of an account's launches (``Account.log``: ``name``, ``bytes``,
        ``flops``)."""
        return sum(self.launch_seconds(x.name, x.bytes, x.flops) for x in launches)

    def as_dict(self) -> Dict[str, Any]:
        return {"launch_us": self.launch_s * 1e6,
                "bandwidth_gb_per_s": {c: self.bandwidth[c] / 1e9 for c in CLASSES},
                "tflops": self.flops_rate / 1e12, "source": self.source}


def load() -> Calibrated:
    """The shipped constants (``fitted.CONSTANTS``)."""
    from . import fitted

    c: Dict[str, Any] = dict(fitted.CONSTANTS)
    return Calibrated(c["launch_us"] * 1e-6,
                      {k: v * 1e9 for k, v in c["bandwidth_gb_per_s"].items()},
                      c["tflops"] * 1e12, c["source"])
