"""doctor's performance advice for Iluvatar's own stack: settings the shim never sets itself.

``ENABLE_CUSTOM_IPC=1`` switches ixformer's all-reduce (the collective CoreX 3.2.3's vLLM uses
for tensor parallelism: its engine arguments force ``disable_custom_all_reduce=True``) from
NCCL to ixformer's same-node CUDA-IPC path.  The field measured +44.6% decode tokens/s at P10
with four-way tensor parallelism, greedy outputs no longer byte-identical (the fp16 reduction
order changes) and a 64 MiB shared region per rank (``docs/corex-3.2.3.md``, "Tensor-parallel
all-reduce").  It is advice for the operator: the shim never sets the variable, and the line
is shown only on an Iluvatar stack where the variable is unset.

Stdlib only; imported by doctor.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Tuple

IPC = "ENABLE_CUSTOM_IPC"

#: (state, name, detail), as doctor's sections hold them.
Check = Tuple[str, str, str]


def ipc_hint(vendor: bool, environ: Optional[Mapping[str, Any]] = None) -> Optional[Check]:
    """The hint line for ``ENABLE_CUSTOM_IPC`` on an Iluvatar stack (``vendor``), or None
    (not Iluvatar, or the operator has set the variable, to any value)."""
    env = os.environ if environ is None else environ
    if not vendor or IPC in env:
        return None
    return ("hint", IPC, "unset; performance hint for tensor-parallel servers "
            "(--tensor-parallel-size > 1): ENABLE_CUSTOM_IPC=1 makes ixformer's all-reduce use "
            "its same-node CUDA-IPC path instead of NCCL; the field measured +44.6% decode "
            "tokens/s at P10 with TP4 (greedy outputs not byte-identical: the fp16 reduction "
            "order changes; a 64 MiB shared region per rank). Advice only: the shim never sets "
            "it")
