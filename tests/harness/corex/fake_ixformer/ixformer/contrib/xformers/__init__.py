"""Fake ``ixformer.contrib.xformers``: Iluvatar's xformers-compatible flash attention.

What CoreX 3.2.3's XFormers backend imports from it (``docs/corex-3.2.3.md``):
``ixformer.contrib.xformers.ops`` (``xops.fmha.flash.FwOp``,
``xops.memory_efficient_attention_forward``) and ``ops.fmha.attn_bias``
(``BlockDiagonalCausalMask``, ``LowerTriangularMaskWithTensorBias``).  The forward is the CPU
reference of the stand-in's ``xformers`` (the vendor stack has xformers installed; the vendor
backend imports ``AttentionBias`` and ``BlockDiagonalMask`` from it), with grouped-query
heads taken as given (``[B, M, H, K]`` queries over ``[B, N, KV, K]`` keys: the vendor backend
no longer expands them) and the BI-V100 hazards above head size 128 (field notes
``qwen3_6_scripts/patch_xformers_sdpa_seq.py``):

- a causal bias (``BlockDiagonalCausalMask``, its local-attention form, ``LowerTriangularMask``)
  raises ``BI100FlashError``;
- any other bias (a tensor, ``LowerTriangularMaskWithTensorBias``, a non-causal block-diagonal
  mask) returns wrong values silently: zeros (on the card the answer decodes to all "!").
"""

from . import ops

__all__ = ["ops"]
