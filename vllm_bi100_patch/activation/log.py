"""The shim's one logger, ``vllm.bi100_patch`` (a child of vLLM's own ``vllm`` logger, so its
lines appear wherever vLLM's do).

Every module logs through ``from ._log import log`` (``from .._log import log`` below the top
level).  ``logging`` itself is imported on the first message, not at interpreter start, where
the bootstrap runs in every Python process of the environment.
"""

from __future__ import annotations

NAME = "vllm.bi100_patch"
TYPE_CHECKING = False


class _LazyLogger:
    """Forwards every attribute to ``logging.getLogger(NAME)``, importing logging on first use."""

    def __getattr__(self, attr: str) -> object:
        import logging

        return getattr(logging.getLogger(NAME), attr)


if TYPE_CHECKING:
    import logging

    log: logging.Logger
else:
    log = _LazyLogger()
