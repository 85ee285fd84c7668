"""The block table of a chunk past its cached prefix: vLLM 0.6.3's engine bug, fixed where it
is made.

Catalogue entry: row ``prefix_block_table`` of ``vllm_bi100_patch.patching.table``.

With chunked prefill and prefix caching on (BI-V100 servers run both; vLLM 0.6.3 turns
chunked prefill on by itself above 32K for models that are not multimodal),
``ModelInputForGPUBuilder._compute_for_prefix_cache_hit``
keeps ``inter_data.prefix_cache_hit = True`` for every later chunk of a prompt whose first
blocks were cached, and ``CommonMetadataBuilder._add_seq_group`` then takes
``block_table = computed_block_nums``: only the cached prefix's blocks, fewer than a chunk past
the prefix needs.  One such sequence in a batch gets a short table (the prefix kernel's check
raises); batched with others, its row is zero-padded to their width and block 0 is read as its
context (silently wrong tokens).  vLLM fixed it in pull request #9532 (first release 0.6.4):
under ``prefix_cache_hit`` the block table is the sequence's own, ``block_tables[seq_id]``.

The wrapper does the same: while the original ``_add_seq_group`` runs for a sequence group with
a prefix-cache hit, the group's ``computed_block_nums`` is the sequence's own block table (the
only use the method makes of it is that assignment, which the code check proves), so the
method appends exactly what 0.6.4's does; the attribute is restored afterwards.  Applied only
where the method still assigns ``block_table = computed_block_nums`` (``fix_needed``), and only
on the code shapes in ``KNOWN``.

Imported only once vLLM's ``vllm.attention.backends.utils`` is; never imports vLLM itself.
"""

from __future__ import annotations

import ast
import inspect
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..activation import config
from ..patching.code_shapes import fingerprint
from ..patching.source import function_def
from ..patching.versions import Family
from ..patching.factories import ArgReader, Wrapper, counter

OWNER = "CommonMetadataBuilder"
ATTR = "_add_seq_group"
PARAMS = ("self", "inter_data", "chunked_prefill_enabled")
COUNTER = "prefix_block_table"
FIXED_CALLS = counter(COUNTER)

#: Fingerprints (``fingerprint``) of the ``_add_seq_group`` bodies this row was checked
#: against, each one read in the official wheels named (the CoreX stand-in's file is the
#: official 0.6.3.post1 one).
KNOWN: Dict[str, str] = {
    "7848bcf2cba3f29c": "vLLM 0.6.3.post1 (CoreX 3.2.3's base)",
    # Differs from 0.6.3's only in the compute_slot_mapping_start_idx call; Iluvatar's
    # vendored CoreX 3.2.3 tree has this one (docs/prefix-block-table.md).
    "e41c61b3201c3dd5": "vLLM 0.5.4, 0.5.5, 0.6.0, 0.6.1.post2, 0.6.2; CoreX 3.2.3's vendor tree",
}

PR = "vLLM pull request #9532"


def _hit_branch_value(fn: ast.FunctionDef) -> Optional[str]:
    """What ``block_table`` is set to under ``if inter_data.prefix_cache_hit:`` (as source
    text), or None when the method has no such branch."""
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Attribute) \
                and node.test.attr == "prefix_cache_hit":
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
                        and isinstance(stmt.targets[0], ast.Name) \
                        and stmt.targets[0].id == "block_table":
                    return ast.unparse(stmt.value)
    return None


def _method(module: types.ModuleType) -> Optional[Callable[..., Any]]:
    cls = vars(module).get(OWNER)
    if not isinstance(cls, type):
        return None
    for klass in cls.__mro__:
        if ATTR in vars(klass):
            desc = vars(klass)[ATTR]
            return getattr(desc, "__wrapped__", desc)  # our own wrapper: its original
    return None


def fix_needed(module: types.ModuleType, settings: config.Settings) -> Optional[str]:
    """None when this build's ``CommonMetadataBuilder._add_seq_group`` still gives a chunk
    with a prefix-cache hit ``computed_block_nums`` as its block table; else why the row is
    not needed (the upstream fix is there, or the builder this fix is for is absent)."""
    method = _method(module)
    if method is None:
        return f"{module.__name__} has no {OWNER}.{ATTR} (the builder this fixes is absent)"
    fn = function_def(method)
    if fn is None:
        return f"the source of {OWNER}.{ATTR} cannot be read; nothing to fix"
    value = _hit_branch_value(fn)
    if value == "computed_block_nums":
        return None
    if value == "block_tables[seq_id]":
        return f"this build has the upstream fix ({PR}: block_table = block_tables[seq_id])"
    return (f"{OWNER}.{ATTR} does not set block_table = computed_block_nums under "
            "prefix_cache_hit (not the code this fix is for)")


def check(func: Callable[..., Any]) -> Optional[str]:
    """The row's code check: the method's parameters, the one use of ``computed_block_nums``
    the wrapper relies on, and the exact code shape (a fingerprint in ``KNOWN``)."""
    where = f"{OWNER}.{ATTR}"
    try:
        params = tuple(inspect.signature(func).parameters)
    except (TypeError, ValueError) as exc:
        return f"{where} has no readable signature ({exc})"
    if params != PARAMS:
        return f"{where} parameters {list(params)} differ from {list(PARAMS)}"
    fn = function_def(func)
    if fn is None:
        return f"the source of {where} cannot be read"
    uses = _uses(fn, "computed_block_nums")
    if uses != ["computed_block_nums = inter_data.computed_block_nums",
                "block_table = computed_block_nums"]:
        return f"{where} uses computed_block_nums otherwise than the fix relies on: {uses}"
    print_ = fingerprint(func)
    if print_ not in KNOWN:
        return (f"{where} has the prefix_cache_hit bug but a code shape this fix was not "
                f"checked against (fingerprint {print_}; known: "
                + ", ".join(f"{k} = {v}" for k, v in KNOWN.items()) + ")")
    return None


def _uses(fn: ast.FunctionDef, name: str) -> List[str]:
    """The statements (as source text) that mention ``name``, outermost first."""
    out = []
    for node in ast.walk(fn):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Expr, ast.Return)) and any(
                isinstance(n, (ast.Name, ast.Attribute)) and
                (getattr(n, "id", None) == name or getattr(n, "attr", None) == name)
                for n in ast.walk(node)):
            out.append(ast.unparse(node))
    return out


def make_wrapper(family: Family, original: Callable[..., Any], module: types.ModuleType,
                 settings: config.Settings) -> Wrapper:
    reader = ArgReader.for_function(original, PARAMS[1:], ATTR)

    def _add_seq_group(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                       kwargs: Dict[str, Any]) -> Any:
        inter_data = reader.read(args, kwargs)[0]
        tables = inter_data.block_tables
        if not inter_data.prefix_cache_hit or not tables:
            return wrapped(*args, **kwargs)
        seq_ids = list(inter_data.seq_ids)
        if len(seq_ids) != 1:  # vLLM asserts one sequence per prompt group before this
            raise RuntimeError(f"{ATTR}: a prefix-cache hit in a group of {len(seq_ids)} "
                               "sequences; the fix (one block table per group) needs one")
        own = tables.get(seq_ids[0])
        if own is None:
            return wrapped(*args, **kwargs)
        cached = inter_data.computed_block_nums
        FIXED_CALLS.add()
        inter_data.computed_block_nums = own
        try:
            return wrapped(*args, **kwargs)
        finally:
            inter_data.computed_block_nums = cached

    return _add_seq_group
