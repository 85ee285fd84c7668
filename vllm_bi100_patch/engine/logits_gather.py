"""A step that samples nothing on a tensor-parallel rank > 0: CoreX 3.2.3's engine-killer.

Catalogue entry: row ``tp_empty_logits`` of ``vllm_bi100_patch.patching.table``.

Iluvatar's ``LogitsProcessor.forward`` (``vllm/model_executor/layers/logits_processor.py`` of
CoreX 3.2.3, ``docs/corex-3.2.3.md``) builds an empty ``[0, vocab]`` logits tensor when no
token of the step is selected for sampling, instead of gathering.  Ranks > 0 of a
tensor-parallel group receive a ``SamplingMetadata`` with ``seq_groups=None``
(``_init_sampling_metadata_from_tensor_dict``, ``vllm/worker/model_runner_base.py``); stock
vLLM's gather returns None there and the logits processors are skipped, but the vendor's empty
tensor is not None, so ``_apply_logits_processors`` iterates ``None``: ``TypeError: 'NoneType'
object is not iterable`` and the worker dies.  Every step that samples nothing does it: each
non-final chunk of a prompt longer than ``max_num_batched_tokens`` under chunked prefill.

The wrapper returns None, what stock vLLM returns on a rank > 0 (the rank's logits are thrown
away: ``if not self.is_driver_worker: return []`` follows), for exactly that case: metadata
without sequence groups, hidden states (not logits) as input, no token selected.  No rank
gathers in that case in the vendor's code (every rank sees the same broadcast
``selected_token_indices``), so skipping it changes no collective.  Everything else runs the
original.  Applied only where ``forward`` has the vendor's empty-tensor branch
(``logits_needed``) and only on the code shapes in ``KNOWN``.  Never imports vLLM.
"""

from __future__ import annotations

import ast
import types
from typing import Any, Callable, Dict, Optional, Tuple

from ..activation import config
from ..patching.versions import Family
from ..patching import code_shapes
from ..patching.factories import ArgReader, Wrapper, counter

OWNER = "LogitsProcessor"
ATTR = "forward"
PARAMS = ("self", "lm_head", "hidden_states", "sampling_metadata", "embedding_bias")
CALLS = counter("tp_empty_logits")

#: Code shapes (``block_tables.fingerprint``) of ``LogitsProcessor.forward`` this row was
#: checked against; the stand-in's file is the vendor's method on the official 0.6.3.post1 file.
KNOWN: Dict[str, str] = {
    "8a152a6592e3e14f": "CoreX 3.2.3's vendored tree (wudixzy/competition@5a1c8c79)",
}


def _empty_branch(fn: ast.FunctionDef) -> bool:
    """Whether ``fn`` has ``if hidden_states.shape[0] > 0: ... else: logits = torch.empty(...)``
    (the vendor's branch that skips the gather when nothing is selected)."""
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and "hidden_states.shape[0] > 0" == ast.unparse(node.test):
            return any(isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "logits"
                       and ast.unparse(s.value).startswith("torch.empty(") for s in node.orelse)
    return False


def logits_needed(module: types.ModuleType, settings: config.Settings) -> Optional[str]:
    """None when this build's ``LogitsProcessor.forward`` makes an empty logits tensor instead
    of gathering when nothing samples; else why the row is not needed."""
    fn, why = code_shapes.definition(module, OWNER, ATTR)
    if fn is None:
        return why
    if _empty_branch(fn):
        return None
    return (f"the build's {OWNER}.{ATTR} gathers even when no token samples (ranks > 0 get "
            "None and skip the logits processors)")


def check(func: Callable[..., Any]) -> Optional[str]:
    """The row's code check: the parameters and one of the ``KNOWN`` code shapes."""
    return code_shapes.shape_check(func, f"{OWNER}.{ATTR}", PARAMS, KNOWN)


def make_wrapper(family: Family, original: Callable[..., Any], module: types.ModuleType,
                 settings: config.Settings) -> Wrapper:
    reader = ArgReader.for_function(original, PARAMS[1:], ATTR)

    def forward(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                kwargs: Dict[str, Any]) -> Any:
        metadata = reader.read(args, kwargs)[2]
        if metadata is not None and metadata.seq_groups is None \
                and not instance.logits_as_input \
                and metadata.selected_token_indices.numel() == 0:
            CALLS.add()
            return None  # stock vLLM's answer on a rank > 0
        return wrapped(*args, **kwargs)

    return forward
