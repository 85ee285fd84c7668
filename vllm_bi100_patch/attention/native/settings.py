"""The decode routing of the shim's settings on this machine: ``VLLM_BI100_*`` (the fallback
threshold, SM count and occupancy, subscription, V1's limit) and whether this is an Iluvatar
card, as the ``Routing`` a route table takes.  Part of the native decoder; never imports vLLM.
"""

from __future__ import annotations

from ...activation import config
from ...patching import hardware
from .routes import Routing

__all__ = ["routing_for"]


def routing_for(settings: config.Settings) -> Routing:
    """The decode routing of ``settings`` on this machine (built on the decoder's first use,
    in the process that decodes: a device query in vLLM's front end before it forks workers
    would break CUDA in the children)."""
    s = settings
    iluvatar = s.v1_max_seq_len is None and (
        hardware.looks_like_iluvatar() or bool(hardware.device_facts().get("iluvatar")))
    return Routing(fallback_above=s.decode_fallback_above,
                   sm_count=hardware.sm_count(s.sm_count), sm_occupancy=s.sm_occupancy,
                   subscription=s.subscription, v1_max_seq_len=s.v1_max_seq_len,
                   iluvatar=iluvatar)
