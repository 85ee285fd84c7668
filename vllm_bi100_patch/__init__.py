"""vllm-bi100-patch: a runtime shim that makes stock vLLM safe on Iluvatar BI-V100.

Public API: ``apply()``, ``revert()``, ``status()``. Importing this package is cheap (no torch,
no vLLM, no wrapt): the ``.pth`` line and ``sitecustomize`` import it in every interpreter.
"""

from __future__ import annotations

import sys

from ._version import __version__
from .ops.status import status

TYPE_CHECKING = False  # typing itself costs milliseconds at interpreter start

if TYPE_CHECKING:
    from typing import Any, Dict, Optional

__all__ = ["apply", "revert", "status", "__version__"]


def apply(strict: Optional[bool] = None) -> Dict[str, Any]:
    """Activate the shim explicitly, on any hardware (hardware auto-detection is skipped;
    ``VLLM_BI100_PATCH=0`` still wins). Patches now if vLLM's paged_attn is imported, else
    when it is. Idempotent. Returns ``status()``.

    With ``strict=True`` (or ``VLLM_BI100_PATCH_STRICT=1``) an invalid variable raises
    ``config.ConfigError``, and an unsupported vLLM version or a failed code check raises
    ``strict.PatchError`` (now if vLLM is installed, whether or not it is imported yet),
    instead of a WARNING.
    """
    from .activation import bootstrap

    bootstrap.apply(strict)
    return status()


def revert() -> Dict[str, Any]:
    """Undo everything ``apply()`` and the start-up activation did in this process, under one
    lock: the exact original descriptors of the patched methods come back, the post-import
    hook and the import guard leave ``sys.meta_path``, real ``context_attention_fwd``
    references the guard re-pointed are restored, and a substitute ``prefix_prefill`` module
    leaves ``sys.modules`` (its name is removed from the vLLM modules that imported it).
    Future imports are not patched until ``apply()``. Returns ``status()``."""
    from .activation import bootstrap

    with bootstrap._lock:
        bootstrap.deactivate()
        if "vllm_bi100_patch.patching.registry" in sys.modules:
            from .patching import registry

            registry.revert_all()
    return status()
