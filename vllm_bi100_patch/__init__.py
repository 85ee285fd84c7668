"""vllm-bi100-patch: a runtime shim that makes stock vLLM safe on Iluvatar BI-V100.

Public API: ``apply()``, ``revert()``, ``status()``. Importing this package is cheap (no torch,
no vLLM, no wrapt): the ``.pth`` line and ``sitecustomize`` import it in every interpreter.
"""

from __future__ import annotations

import sys
TYPE_CHECKING = False  # typing itself costs milliseconds at interpreter start

if TYPE_CHECKING:
    from typing import Any, Dict, Optional

__version__ = "0.1.0"
__all__ = ["apply", "revert", "status", "__version__"]


def apply(strict: Optional[bool] = None) -> Dict[str, Any]:
    """Activate the shim explicitly, on any hardware (hardware auto-detection is skipped;
    ``VLLM_BI100_PATCH=0`` still wins). Patches now if vLLM's paged_attn is imported, else
    when it is. Idempotent. Returns ``status()``.

    With ``strict=True`` (or ``VLLM_BI100_PATCH_STRICT=1``) an invalid variable, an unsupported
    vLLM version or a failed code check raises instead of logging a warning.
    """
    from . import _bootstrap

    _bootstrap.activate("apply", force=True, strict=strict)
    strict_now = _bootstrap.state()["strict"]
    if strict_now and _bootstrap.state()["active"]:
        from . import versions

        info = versions.installed_vllm_version()
        if versions.family_for(info) is None:
            from .registry import PatchError

            raise PatchError(f"vLLM {info.raw or 'not installed'} is not supported by "
                             "vllm-bi100-patch; nothing patched")
        if "vllm_bi100_patch.registry" in sys.modules:
            from . import registry

            reason = registry.last_report().reason
            if reason is not None:
                raise registry.PatchError(reason)
    return status()


def revert() -> Dict[str, Any]:
    """Restore the exact original descriptors, remove the import guard, stop patching future
    imports in this process. Returns ``status()``."""
    from . import _bootstrap

    _bootstrap.deactivate()
    if "vllm_bi100_patch.registry" in sys.modules:
        from . import registry

        registry.revert_all()
    return status()


def status() -> Dict[str, Any]:
    """Facts about this process: configuration, vLLM version and family, what is patched,
    the import guard, call and route counters. Imports nothing heavy."""
    from . import _bootstrap, config, versions

    info = versions.installed_vllm_version()
    family = versions.family_for(info)
    settings = config.load()
    data: Dict[str, Any] = {
        "shim_version": __version__,
        "mode": settings.mode,
        "disabled": list(settings.disabled),
        "vllm_version": info.raw,
        "family": family.name if family else None,
        "supported": family is not None,
        **_bootstrap.state(),
        "patched": [],
        "report": None,
        "counts": {},
        "native_ops": None,
        "serving_path": versions.serving_path_note(info),
    }
    if "vllm_bi100_patch.registry" in sys.modules:
        from . import registry

        data["patched"] = registry.patched_attributes()
        data["report"] = registry.last_report().as_dict()
    if "vllm_bi100_patch.patches.paged_attention" in sys.modules:
        from .patches import paged_attention

        data["counts"] = paged_attention.call_counts()
        data["native_ops"] = paged_attention.native_profile()
    from . import import_guard  # cheap: no typing, no logging at import

    data["import_guard"] = import_guard.state()
    return data
