"""The attention benchmark's cases: shapes, inputs, the kernel call of each row, its account.

A *row* is one ``Case``: an operation (``decode``, ``prefix``, ``dense``), its sizes, a
``Shape`` (heads, head size, block, dtype) and a formulation (``kind``):

- ``default``: what the device runs by default (on CPU: float32 compute, and the SDPA
  prefix path where allowed);
- ``tiled``: the tiled prefix path in the device's compute mode (on CPU: float32);
- ``native``: the tiled prefix path with the GPU compute mode forced
  (``forced(compute="native")``: half-precision matrix products with float32
  accumulation) and the GPU's tile layout (``layout="generic"``: strided gathers
  straight into the staging buffers), the algorithm, numerics and gathers every GPU runs.

``account_row`` counts one row's call with ``tools.account.Account`` (launches, bytes,
FLOPs, host reads) in the row's formulation, on the tensors it is given (CPU tensors stand in
for the card: the convention of issue 19's table, whose figures the field shape's ``native``
rows reproduce for that issue's starting kernels), and adds the modelled times of
``tools.account.DEVICES``.  On CPU the
half-precision matrix products inside the count run in float32 (``HalfGemmsInFloat``): the
same ops are logged with the same operands, only the arithmetic is done faster (this CPU
has no native float16 GEMM); the counts do not depend on it (tested).

``Kernels`` names the kernels a row calls: this checkout's (``this_package()``), or another
checkout's (``load_baseline(DIR)``, for ``--baseline``).  Used by ``scripts/bench_attention.py``,
``scripts/profile_kernels.py`` and their tests; not part of the package.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import math
import os
import sys
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import torch

from tools.account import DEVICES, Account, HalfGemmsInFloat, predict

__all__ = ["BENCH", "FIELD", "FIELD_FIGURES", "Case", "Inputs", "Kernels", "Shape",
           "account_row", "build", "call", "load_baseline", "sections", "this_package"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
Fn = Callable[[], Any]


@dataclasses.dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_size: int
    block: int
    dtype: torch.dtype

    @property
    def elem(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def describe(self) -> str:
        name = {v: k for k, v in DTYPES.items()}[self.dtype]
        return (f"{self.heads} query / {self.kv_heads} KV heads x {self.head_size}, {name}, "
                f"block {self.block}")


#: The benchmark's own shape (a 7-8B model's layer: 32/8 heads of 128).
BENCH = Shape(32, 8, 128, 16, torch.bfloat16)
#: The field's per-rank shape (issue 19): 4 query / 1 KV heads of 256, float16, block 16.
FIELD = Shape(4, 1, 256, 16, torch.float16)


@dataclasses.dataclass(frozen=True)
class Case:
    """One row: ``op`` over ``batch`` sequences of ``ctx`` cached tokens (decode: the
    sequence length) plus ``new`` tokens (decode: 1; dense: the prompt, ``ctx`` = 0)."""

    op: str
    batch: int
    ctx: int
    new: int = 1
    kind: str = "default"
    shape: Shape = BENCH
    timed: bool = True

    @property
    def base(self) -> str:
        """The case without its formulation, e.g. ``prefix 1x(16384+512)``."""
        return {"decode": f"decode {self.batch}x{self.ctx}",
                "prefix": f"prefix {self.batch}x({self.ctx}+{self.new})",
                "dense": f"dense {self.batch}x{self.new}"}[self.op]

    @property
    def name(self) -> str:
        return self.base if self.kind == "default" else f"{self.base} {self.kind}"

    @property
    def kv_tokens(self) -> int:
        """Tokens of K/V each sequence attends to (decode: the new token is in the cache)."""
        return self.ctx if self.op == "decode" else self.ctx + self.new

    @property
    def q_tokens(self) -> int:
        return 1 if self.op == "decode" else self.new

    def minimal_bytes(self) -> int:
        """K and V read once, the query read and the output written once."""
        s = self.shape
        return s.elem * self.batch * (2 * self.kv_tokens * s.kv_heads * s.head_size
                                      + 2 * self.q_tokens * s.heads * s.head_size)

    def kv_bytes(self) -> int:
        """Bytes of K/V the call reads (the share of the cache in the minimal bytes)."""
        s = self.shape
        return 2 * s.elem * self.batch * self.kv_tokens * s.kv_heads * s.head_size


#: The field's own PyTorch fallback at its per-rank shape (issue 19's table: launches,
#: bytes / minimal), counted in its GPU compute mode; source: ``wudixzy/competition``,
#: ``qwen3_6_scripts/paged_attn.py`` on branch ``prep/M1-48-on-M1-49-20260722``.
FIELD_FIGURES: Dict[str, Tuple[int, float]] = {
    "decode 1x32768": (14, 10.06),
    "decode 1x65536": (14, 10.06),
    "prefix 1x(16384+512)": (1352, 84.9),
    "prefix 1x(32768+256)": (2632, 54.7),
}


# --- kernels ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Kernels:
    """The kernel functions a row calls and what forces a formulation: the checkout's
    ``kernels.forced`` module, or (``None``, a checkout older than it) the module globals
    that did (``prefix.FORCE_PATH``, ``_common.FORCE_COMPUTE``/``FORCE_LAYOUT``)."""

    label: str
    paged_decode: Callable[..., torch.Tensor]
    paged_prefix: Callable[..., torch.Tensor]
    varlen_attention: Callable[..., torch.Tensor]
    prefix: Any
    common: Any  # an older checkout's ``kernels._common`` (None where ``forced`` is there)
    forced: Any = None


def _kernel_module(package: str, name: str) -> Any:
    """A kernels module of ``package`` (this tree or a baseline commit's): the kernels live
    in ``attention.kernels`` now (at the package's top level in older commits), the prompt
    kernels in ``kernels.prefill`` (at ``kernels``' top level in older commits still)."""
    moved = {"prefix": "prefill.prefix", "dense": "prefill.dense"}.get(name, name)
    for kernels in ("attention.kernels", "kernels"):
        for module in (moved, name):
            try:
                return importlib.import_module(f"{package}.{kernels}.{module}")
            except ModuleNotFoundError:
                continue
    raise ModuleNotFoundError(f"no kernels module {name!r} in {package}")


def _kernels(label: str, package: str) -> Kernels:
    mods = {name: _kernel_module(package, name) for name in ("decode", "prefix", "dense")}
    try:
        forced, common = _kernel_module(package, "forced"), None
    except ModuleNotFoundError:
        # a checkout from before ``kernels.forced``: its ``_common`` held the compute hooks
        forced, common = None, _kernel_module(package, "_common")
    return Kernels(label, mods["decode"].paged_decode, mods["prefix"].paged_prefix,
                   mods["dense"].varlen_attention, mods["prefix"], common, forced)


def this_package() -> Kernels:
    return _kernels("this checkout", "vllm_bi100_patch")


def load_baseline(root: str) -> Kernels:
    """The kernels of another checkout of this project (e.g. ``git worktree add DIR main``),
    imported under their own package name, ``bi100_baseline``."""
    pkg = os.path.join(os.path.abspath(root), "vllm_bi100_patch")
    spec = importlib.util.spec_from_file_location(
        "bi100_baseline", os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg])
    if spec is None or spec.loader is None or not os.path.isdir(pkg):
        raise SystemExit(f"--baseline {root}: no vllm_bi100_patch package there")
    if "bi100_baseline" not in sys.modules:
        module = importlib.util.module_from_spec(spec)
        sys.modules["bi100_baseline"] = module
        spec.loader.exec_module(module)
    return _kernels(f"baseline {root}", "bi100_baseline")


@contextlib.contextmanager
def formulation(kind: str, kernels: Kernels) -> Iterator[None]:
    """Force ``kind`` (``default``, ``tiled``, ``native``) in ``kernels`` while inside."""
    overrides = {"default": {}, "tiled": {"path": "tiled"},
                 "native": {"path": "tiled", "compute": "native", "layout": "generic"}}[kind]
    if kernels.forced is not None:
        with kernels.forced.forced(**overrides):
            yield
        return
    # An older checkout: its kernels' module globals.
    hooks = {"path": (kernels.prefix, "FORCE_PATH"), "compute": (kernels.common, "FORCE_COMPUTE"),
             "layout": (kernels.common, "FORCE_LAYOUT")}
    forced = {hooks[name]: value for name, value in overrides.items()}
    if kind == "native" and not hasattr(kernels.common, "FORCE_COMPUTE"):
        raise SystemExit(f"{kernels.label}: kernels._common has no FORCE_COMPUTE hook")
    # A prefix without FORCE_PATH has one path (the tiled one): nothing to force there.
    saved = {(mod, attr): getattr(mod, attr) for mod, attr in forced if hasattr(mod, attr)}
    try:
        for (mod, attr) in saved:
            setattr(mod, attr, forced[(mod, attr)])
        yield
    finally:
        for (mod, attr), value in saved.items():
            setattr(mod, attr, value)


# --- inputs -----------------------------------------------------------------------------

@dataclasses.dataclass
class Inputs:
    """A row's tensors: ``args`` of the kernel call, ``lens`` (tokens in the cache per
    sequence, decode and prefix)."""

    case: Case
    args: Tuple[torch.Tensor, ...]
    lens: List[int]


def make_paged(lens: Sequence[int], shape: Shape, device: str, seed: int = 0
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches in vLLM's layout and block tables (a random permutation of blocks)."""
    g = torch.Generator().manual_seed(seed)
    x = 16 // shape.elem
    per_seq = [math.ceil(n / shape.block) for n in lens]
    num_blocks = sum(per_seq) + 1
    kc = torch.randn(num_blocks, shape.kv_heads, shape.head_size // x, shape.block, x,
                     generator=g).to(shape.dtype)
    vc = torch.randn(num_blocks, shape.kv_heads, shape.head_size, shape.block,
                     generator=g).to(shape.dtype)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    at = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = perm[at:at + n].to(torch.int32)
        at += n
    return kc.to(device), vc.to(device), tables.to(device)


def dense_kv(kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor, longest: int
             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The cached K/V of every sequence, contiguous ``[batch, kv_heads, longest, head]``."""
    batch, width = tables.shape
    kv_heads, block = vc.shape[1], vc.shape[3]
    head = vc.shape[2]
    ids = tables.long()
    keys = kc[ids].permute(0, 2, 1, 4, 3, 5).reshape(batch, kv_heads, width * block, head)
    values = vc[ids].permute(0, 2, 1, 4, 3).reshape(batch, kv_heads, width * block, head)
    return keys[:, :, :longest].contiguous(), values[:, :, :longest].contiguous()


def build(case: Case, device: str) -> Inputs:
    """The row's inputs on ``device`` (deterministic: fixed seeds)."""
    s = case.shape
    g = torch.Generator().manual_seed(1)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g).to(s.dtype).to(device)

    if case.op == "decode":
        lens = [case.ctx] * case.batch
        kc, vc, bt = make_paged(lens, s, device)
        sl = torch.tensor(lens, dtype=torch.int32, device=device)
        return Inputs(case, (rand(case.batch, s.heads, s.head_size), kc, vc, bt, sl), lens)
    tokens = case.batch * case.new
    q = rand(tokens, s.heads, s.head_size)
    k, v = rand(tokens, s.kv_heads, s.head_size), rand(tokens, s.kv_heads, s.head_size)
    if case.op == "dense":
        return Inputs(case, (q, k, v), [])
    lens = [case.ctx] * case.batch
    kc, vc, bt = make_paged(lens, s, device)
    qsl = (torch.arange(case.batch + 1, dtype=torch.int32) * case.new).to(device)
    sl = torch.full((case.batch,), case.ctx + case.new, dtype=torch.int32, device=device)
    cl = torch.full((case.batch,), case.ctx, dtype=torch.int32, device=device)
    return Inputs(case, (q, k, v, kc, vc, bt, qsl, sl, cl), lens)


def call(inputs: Inputs, kernels: Kernels) -> Fn:
    """The row's kernel call in its formulation, as a function of no arguments."""
    case, args = inputs.case, inputs.args
    scale = case.shape.head_size ** -0.5
    if case.op == "decode":
        def run() -> Any:
            return kernels.paged_decode(*args, scale, max_seq_len=case.ctx)
    elif case.op == "prefix":
        def run() -> Any:
            return kernels.paged_prefix(*args)
    else:
        def run() -> Any:
            return kernels.varlen_attention(*args, [case.new] * case.batch, scale, causal=True)

    def forced() -> Any:
        with formulation(case.kind, kernels):
            return run()

    return forced


# --- account ----------------------------------------------------------------------------

def account_row(inputs: Inputs, kernels: Kernels) -> Dict[str, Any]:
    """The account of one call of the row (the call runs once, on the inputs' device)."""
    fn = call(inputs, kernels)
    fast = HalfGemmsInFloat() if inputs.args[0].device.type == "cpu" else contextlib.nullcontext()
    with fast:
        with Account() as acc:
            fn()
    minimal = inputs.case.minimal_bytes()
    return {"launches": acc.launches, "host_reads": acc.host_reads, "bytes": acc.bytes,
            "minimal": minimal, "flops": acc.flops,
            "model_s": {key: predict(acc, dev) for key, dev in DEVICES.items()}}


def sections(quick: bool, gpu: bool, bench_dtype: torch.dtype
             ) -> List[Tuple[str, List[Case]]]:
    """(title, rows) of the two shapes.  On CPU the field shape's GPU-compute-mode rows are
    account only; on GPUs every row runs the device's own formulation and is timed."""
    bench = dataclasses.replace(BENCH, dtype=bench_dtype)
    if quick:
        dec, pre = [(2, 256), (1, 1024)], [(1, 256, 64), (2, 128, 32)]
        fdec, fpre, fdense, ftimed = [(1, 1024), (4, 256)], [(1, 512, 64)], [256], [(1, 1024)]
    else:
        dec = [(1, 32768), (1, 131072)] if gpu else [(8, 4096), (1, 32768)]
        pre = [(1, 32768, 512), (4, 8192, 256)] if gpu else [(1, 4096, 512), (4, 2048, 256)]
        fdec = [(1, 32768), (1, 65536), (1, 131072), (8, 4096), (32, 1024)]
        fpre, fdense = [(1, 16384, 512), (1, 32768, 256)], [2048]
        ftimed = [(1, 32768), (1, 65536), (8, 4096), (32, 1024)]
    dkinds, pkinds = (["default"], ["default"]) if gpu else (
        ["default", "native"], ["default", "tiled", "native"])
    rows = [Case("decode", b, c, 1, k, bench) for b, c in dec for k in dkinds]
    rows += [Case("prefix", b, c, n, k, bench) for b, c, n in pre for k in pkinds]
    fkind = "default" if gpu else "native"
    field = [] if gpu else [Case("decode", b, c, 1, "default", FIELD) for b, c in ftimed]
    field += [Case("decode", b, c, 1, fkind, FIELD, timed=gpu) for b, c in fdec]
    field += [Case("prefix", b, c, n, fkind, FIELD, timed=gpu) for b, c, n in fpre]
    field += [Case("dense", 1, 0, n, fkind, FIELD, timed=gpu) for n in fdense]
    return [(f"bench shape: {bench.describe()}", rows),
            (f"field shape (per rank, issue 19): {FIELD.describe()}", field)]
