"""Fake ``ixformer.contrib.xformers.ops.fmha.flash``: the flash forward operator."""


class FwOp:
    """Iluvatar's flash attention forward (what ``op=`` selects; the fake has one kernel)."""

    NAME = "ixformer_flash_fwd"

    def __repr__(self) -> str:
        return "ixformer.contrib.xformers.ops.fmha.flash.FwOp()"
