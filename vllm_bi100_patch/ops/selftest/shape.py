"""The attention shape the selftest measures: one tensor-parallel rank of the operator's model.

From a model directory's ``config.json`` (``Shape.from_config``: the keys Hugging Face
configurations use, a multimodal model's ``text_config`` first) divided by
``--tensor-parallel-size`` as vLLM divides it (query heads split evenly; KV heads split, or
replicated one per rank when there are fewer KV heads than ranks), or given explicitly.
Needs no torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Optional

__all__ = ["DTYPES", "Shape", "ShapeError"]

#: ``--dtype`` / ``torch_dtype`` names and the torch dtype attribute they mean.
DTYPES = {"float16": "float16", "half": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "float": "float32",
          "fp32": "float32"}


class ShapeError(ValueError):
    """The model's configuration or the given shape cannot be used (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """Per-rank attention shape: query and KV heads, head size, layers, dtype name, cache
    block size, the longest context to measure (``max_len``), and where it came from."""

    heads: int
    kv_heads: int
    head_size: int
    layers: int
    dtype: str = "float16"
    block_size: int = 16
    max_len: int = 32768
    source: str = "explicit"

    def __post_init__(self) -> None:
        for name in ("heads", "kv_heads", "head_size", "layers", "block_size", "max_len"):
            if getattr(self, name) < 1:
                raise ShapeError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise ShapeError(f"heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads})")
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise ShapeError(f"dtype must be float16, bfloat16 or float32, got {self.dtype!r}")
        if self.head_size % 16 or self.block_size % 8:
            raise ShapeError(f"head_size ({self.head_size}) must be a multiple of 16 and "
                             f"block_size ({self.block_size}) of 8 (vLLM's cache layout)")

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes one token's keys and values take in the cache (one rank, one layer)."""
        return 2 * self.kv_heads * self.head_size * element_size

    @classmethod
    def from_config(cls, model_dir: str, tensor_parallel_size: int = 1,
                    dtype: Optional[str] = None, block_size: int = 16,
                    max_len: Optional[int] = None) -> "Shape":
        """The per-rank shape of the model in ``model_dir`` (its ``config.json``)."""
        path = os.path.join(model_dir, "config.json")
        try:
            with open(path, encoding="utf-8") as fh:
                cfg = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ShapeError(f"cannot read {path}: {exc}") from exc
        return cls.from_dict(cfg, tensor_parallel_size, dtype, block_size, max_len,
                             source=path)

    @classmethod
    def from_dict(cls, cfg: Dict[str, Any], tensor_parallel_size: int = 1,
                  dtype: Optional[str] = None, block_size: int = 16,
                  max_len: Optional[int] = None, source: str = "config") -> "Shape":
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else None
        merged = dict(cfg, **text) if text else cfg

        def need(*keys: str) -> int:
            for key in keys:
                value = merged.get(key)
                if isinstance(value, int) and not isinstance(value, bool):
                    return value
            raise ShapeError(f"{source}: none of {list(keys)} is an integer")

        heads = need("num_attention_heads", "n_head", "num_heads")
        kv_heads = merged.get("num_key_value_heads") or merged.get("num_kv_heads") or heads
        head_size = merged.get("head_dim") or merged.get("head_size")
        if not isinstance(head_size, int):
            hidden = need("hidden_size", "n_embd", "d_model")
            if hidden % heads:
                raise ShapeError(f"{source}: hidden_size {hidden} is not a multiple of "
                                 f"{heads} heads, and there is no head_dim")
            head_size = hidden // heads
        layers = need("num_hidden_layers", "n_layer", "num_layers")
        name = dtype or str(merged.get("torch_dtype") or "float16")
        if name not in DTYPES:
            raise ShapeError(f"{source}: dtype {name!r} is not one of {sorted(set(DTYPES))}")
        positions = merged.get("max_position_embeddings")
        tp = tensor_parallel_size
        if tp < 1 or heads % tp:
            raise ShapeError(f"tensor-parallel size {tp} does not divide {heads} query heads")
        if kv_heads % tp and tp % kv_heads:
            raise ShapeError(f"tensor-parallel size {tp} and {kv_heads} KV heads: neither "
                             "divides the other (vLLM refuses this too)")
        return cls(heads=heads // tp, kv_heads=max(1, kv_heads // tp), head_size=head_size,
                   layers=layers, dtype=DTYPES[name], block_size=block_size,
                   max_len=max_len or (positions if isinstance(positions, int) else 32768),
                   source=f"{source}, tensor-parallel size {tp}")
