"""Prompt attention (prefill) in pure PyTorch, for the patch layer's ``forward_prefix``
(chunked prefill and prefix-cache hits: replaces vLLM's Triton ``context_attention_fwd``, which
hangs BI-V100 cards) and for the dense prompt row (prompts without a block table whose head
size the vendor's flash ``FwOp`` cannot take).

- ``paged_prefix`` (``prefix.py``): new tokens attend to their sequence's paged cache and to
  each other, causally;
- ``varlen_attention`` (``dense.py``): packed prompts, each attending to itself;
- both on one driver (``_attend.py``) over absolute key tiles (``_plan.py``, ``_stage.py``):
  the SDPA path on CPU (``_sdpa.py``), the tiled path everywhere else (``_tiled.py``), so every
  row is bit-identical however vLLM sliced the prompt.

Never imports vLLM; shared pieces (cache layout, gathers, softmax sums) are in the kernels
package beside this one.
"""

from .prefix import DEFAULT_BUDGET_MB, PrefixStats, alibi_window, paged_prefix, sdpa_path_ok
from .dense import tile_rows, varlen_attention

__all__ = ["DEFAULT_BUDGET_MB", "PrefixStats", "alibi_window", "paged_prefix", "sdpa_path_ok",
           "tile_rows", "varlen_attention"]
