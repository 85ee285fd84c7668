"""V2 scratch buffers: grow-only, one per (device, dtype), sliced per call; and the
CUDA-graph capture test the decoder shares."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from ...activation.log import log

__all__ = ["Scratch", "capturing"]


def capturing() -> bool:
    """True while the current CUDA stream is capturing a graph (False on CPU-only builds)."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except (RuntimeError, AssertionError, AttributeError):  # CPU-only builds raise
        return False


class Scratch:
    """Grow-only flat buffers for ``paged_attention_v2``: one float32 buffer per device for
    ``exp_sums`` and ``max_logits``, one per (device, dtype) for ``tmp_out``.  A buffer that
    was handed out during CUDA-graph capture is kept alive when it is replaced, because the
    captured graph still points at it."""

    def __init__(self) -> None:
        self.buffers: Dict[Tuple[str, str, torch.dtype], torch.Tensor] = {}
        self.captured: Dict[Tuple[str, str, torch.dtype], bool] = {}
        self.retired: List[torch.Tensor] = []

    def _flat(self, role: str, numel: int, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        key = (role, str(device), dtype)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            if buf is not None and self.captured.get(key):
                self.retired.append(buf)
                log.debug("V2 scratch %s grew during/after capture; old buffer kept", key)
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[key] = buf
            self.captured[key] = False
        if capturing():
            self.captured[key] = True
        return buf

    def get(self, num_seqs: int, num_heads: int, partitions: int, head_size: int,
            dtype: torch.dtype, device: torch.device
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        stats = num_seqs * num_heads * partitions
        f32 = self._flat("stats", 2 * stats, torch.float32, device)
        exp_sums = f32[:stats].view(num_seqs, num_heads, partitions)
        max_logits = f32[stats:2 * stats].view(num_seqs, num_heads, partitions)
        tmp = self._flat("tmp_out", stats * head_size, dtype, device)
        tmp_out = tmp[:stats * head_size].view(num_seqs, num_heads, partitions, head_size)
        return exp_sums, max_logits, tmp_out

    def nbytes(self) -> int:
        held = list(self.buffers.values()) + self.retired
        return sum(t.numel() * t.element_size() for t in held)

    def clear(self) -> None:
        self.buffers.clear()
        self.captured.clear()
        self.retired.clear()
