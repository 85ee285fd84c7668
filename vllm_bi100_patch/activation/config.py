"""Every environment variable the shim reads, parsed and validated in one place.

Nothing here imports torch or vLLM: the bootstrap reads this module at interpreter start.
Each variable is declared once in ``VARIABLES`` (name, default, accepted values, meaning);
the README table is generated from that list (``python -m vllm_bi100_patch env-table``).

Accepted values are exactly the documented ones (surrounding spaces ignored; ``auto``, ``never``,
``shim`` and the log levels in any case). An invalid value never raises here: it is recorded,
with the value as given, in ``Settings.errors`` and the variable keeps its default (an invalid
``VLLM_BI100_PATCH`` keeps the shim off). The bootstrap reports the errors once, in processes
that import vLLM; under strict mode it refuses to let vLLM import instead.
"""

from __future__ import annotations

import os

from ..patching import table

TYPE_CHECKING = False  # typing itself costs milliseconds at interpreter start

if TYPE_CHECKING:  # the bootstrap imports this module in every interpreter: keep it bare
    from typing import Callable, Dict, Mapping, Optional, Tuple

MODE = "VLLM_BI100_PATCH"
DISABLE = "VLLM_BI100_PATCH_DISABLE"
STRICT = "VLLM_BI100_PATCH_STRICT"
LOG_LEVEL = "VLLM_BI100_PATCH_LOG_LEVEL"
DECODE_FALLBACK_ABOVE = "VLLM_BI100_DECODE_FALLBACK_ABOVE"
PREFIX_BUDGET_MB = "VLLM_BI100_PREFIX_BUDGET_MB"
SM_COUNT = "VLLM_BI100_SM_COUNT"
SM_OCCUPANCY = "VLLM_BI100_SM_OCCUPANCY"
SUBSCRIPTION = "VLLM_BI100_SUBSCRIPTION"
V1_MAX_SEQ_LEN = "VLLM_BI100_V1_MAX_SEQ_LEN"
DENSE_HEAD_MAX = "VLLM_BI100_DENSE_HEAD_MAX"
METRICS_INTERVAL = "VLLM_BI100_METRICS_INTERVAL_S"
PROMPT_ATTENTION = "VLLM_BI100_PROMPT_ATTENTION"
CONTACT_TIMEOUT = "VLLM_BI100_CONTACT_TIMEOUT_S"
REASONING_PARSER = "VLLM_BI100_REASONING_PARSER"
#: The reasoning parsers the shim serves (``serving/reasoning.py``; upstream's names).
REASONING_PARSERS = ("deepseek_r1", "qwen3")

#: ``Settings.prompt_attention``: the shim computes prompts only where the vendor kernel fails,
#: or every prompt (so that cached and uncached prompts give bit-identical attention rows).
PROMPT_AUTO = "auto"
PROMPT_SHIM = "shim"

#: Names accepted in VLLM_BI100_PATCH_DISABLE: one per row of the patch table.
PATCH_NAMES: Tuple[str, ...] = table.names()

#: ``Settings.mode`` of an invalid ``VLLM_BI100_PATCH``: off, and reported as invalid.
INVALID = "invalid"


class ConfigError(ValueError):
    """An environment variable holds a value the shim does not accept."""


class Variable:
    __slots__ = ("name", "default", "accepted", "meaning")

    def __init__(self, name: str, default: str, accepted: str, meaning: str) -> None:
        self.name, self.default, self.accepted, self.meaning = name, default, accepted, meaning


VARIABLES: Tuple[Variable, ...] = (
    Variable(MODE, "auto", "`auto`, `1`, `0`",
             "`auto`: patch when `ixformer` or a `+corex` torch is installed; `1`: patch on any "
             "hardware (the tests use it on CPU); `0`: kill switch, nothing patched, no import "
             "guard, stock vLLM. Any other value is invalid and keeps the shim off."),
    Variable(DISABLE, "(empty)", "comma list of " + ", ".join(f"`{n}`" for n in PATCH_NAMES),
             "Patches to leave out, e.g. `prefix,import_guard`."),
    Variable(STRICT, "0", "`0`, `1`",
             "`1`: a process that imports vLLM fails at that import (one `ConfigError` or "
             "`PatchError` naming the problem) when a variable is invalid, the vLLM version is "
             "unsupported, or the code check fails; other Python programs are left alone."),
    Variable(LOG_LEVEL, "(inherit)", "`DEBUG`, `INFO`, `WARNING`, `ERROR`",
             "Level of the `vllm.bi100_patch` logger."),
    Variable(DECODE_FALLBACK_ABOVE, "(never)", "integer >= 0, or `never`",
             "Decode goes to the pure-PyTorch kernel when the longest sequence exceeds this many "
             "tokens; `0` forces the fallback always."),
    Variable(PREFIX_BUDGET_MB, "256", "integer >= 1",
             "Peak extra memory (MiB) each pure-PyTorch kernel (decode, prefix, dense prompt) may "
             "use per call; work is tiled to stay under it, whatever the context length, down to "
             "each kernel's minimum working set: for the prompt kernels a row's scores over its "
             "whole context or its sliding window (on GPUs with their residuals: 4 bytes x query "
             "heads per key in float16, 8 in bfloat16, 4 MiB at 262,144 keys and 4 heads in "
             "float16) beside one key tile's staged K/V; for decode on GPUs its products' fixed "
             "chunk (up to 32 MiB of gathered keys) beside one sequence (at the field's shape, "
             "4/1 heads of 256 in float16: about 36 MiB at 4,096 tokens, 41 MiB at 131,072). A "
             "budget below it runs over it, with a WARNING naming it."),
    Variable(SM_COUNT, "(device)", "integer >= 1",
             "SM count used by the V1/V2 decode rule; default: read from the device, 16 (BI-V100) "
             "when it cannot be read."),
    Variable(SM_OCCUPANCY, "1", "integer >= 1", "Attention CTAs per SM in the V1/V2 rule."),
    Variable(SUBSCRIPTION, "5", "integer >= 1", "Subscription factor in the V1/V2 rule."),
    Variable(V1_MAX_SEQ_LEN, "(by build)", "integer >= 1",
             "Longest `max_seq_len` the native V1 kernel is given (it keeps a whole sequence's "
             "logits in shared memory); longer decodes take V2 where it exists, else the "
             "pure-PyTorch decode. Default: 32768 on Iluvatar (ixformer, CoreX torch or an "
             "Iluvatar device, or a vendor `head_mapping` kernel), 8192 otherwise."),
    Variable(DENSE_HEAD_MAX, "128", "integer >= 1",
             "Largest head size the vendor's flash `FwOp` is given for prompts without a cached "
             "prefix (and the profiling run) on builds whose XFormers backend uses ixformer's "
             "`FwOp`; larger heads take the pure-PyTorch varlen attention (row "
             "`dense_prefill`)."),
    Variable(METRICS_INTERVAL, "5", "integer >= 0",
             "Seconds between two writes of a process's `vllm_bi100:` series to "
             "`PROMETHEUS_MULTIPROC_DIR` (where vLLM set it up): the most the shim's series on "
             "`/metrics` lag behind (`docs/metrics-operators.md`). `0`: the shim exports nothing."),
    Variable(PROMPT_ATTENTION, "auto", "`auto`, `shim`",
             "Who computes the attention of prompts without a cached prefix (the XFormers "
             "backend's `_run_memory_efficient_xformers_forward`, and vLLM's profiling run). "
             "`auto`: the backend's own kernel, except where it fails (head sizes above "
             "`VLLM_BI100_DENSE_HEAD_MAX` on builds whose backend uses ixformer's `FwOp`: "
             "the shim's). `shim`: always the shim's pure-PyTorch varlen attention (row "
             "`dense_prefill`, also on stock XFormers backends), so that every prompt and "
             "prefix attention row is the shim's and bit-identical however vLLM slices the "
             "prompt (uncached or a prefix-cache hit, any chunk size); slower than a fused "
             "kernel (`docs/same-prompt.md`)."),
    Variable(CONTACT_TIMEOUT, "15", "integer >= 1",
             "Seconds `selftest` and `doctor` give their first contact with the device (a child "
             "process: `import torch`, `mem_get_info`, one small product) before they call the "
             "card wedged, stop the child and exit 5 (`docs/operating.md`, \"A wedged card\"); "
             "`selftest` then runs its own work in a child under `--hard-limit`."),
    Variable(REASONING_PARSER, "unset (off)", "`deepseek_r1`, `qwen3`",
             "The reasoning parser of every OpenAI server in the process, where `vllm serve`'s "
             "flags cannot carry it (`--enable-reasoning --reasoning-parser NAME`, which the "
             "shim adds to vLLM 0.6.3's command line, win): the thinking before `</think>` is "
             "returned as `reasoning_content` (docs/serving-compat.md, \"Reasoning output\")."),
)


class Settings:
    """The parsed configuration (read-only by convention; ``load()`` makes a new one)."""

    __slots__ = ("mode", "disabled", "strict", "log_level", "decode_fallback_above",
                 "prefix_budget_mb", "sm_count", "sm_occupancy", "subscription", "v1_max_seq_len",
                 "dense_head_max", "metrics_interval_s", "prompt_attention", "contact_timeout_s",
                 "reasoning_parser", "errors", "raw")

    def __init__(self, mode: str = "auto", disabled: Tuple[str, ...] = (), strict: bool = False,
                 log_level: Optional[str] = None, decode_fallback_above: Optional[int] = None,
                 prefix_budget_mb: int = 256, sm_count: Optional[int] = None,
                 sm_occupancy: int = 1, subscription: int = 5,
                 v1_max_seq_len: Optional[int] = None, dense_head_max: int = 128,
                 metrics_interval_s: int = 5, prompt_attention: str = PROMPT_AUTO,
                 contact_timeout_s: int = 15, reasoning_parser: Optional[str] = None,
                 errors: Tuple[str, ...] = (),
                 raw: Optional[Mapping[str, str]] = None) -> None:
        self.mode = mode
        self.disabled = disabled
        self.strict = strict
        self.log_level = log_level
        self.decode_fallback_above = decode_fallback_above
        self.prefix_budget_mb = prefix_budget_mb
        self.sm_count = sm_count
        self.sm_occupancy = sm_occupancy
        self.subscription = subscription
        self.v1_max_seq_len = v1_max_seq_len
        self.dense_head_max = dense_head_max
        self.metrics_interval_s = metrics_interval_s
        self.prompt_attention = prompt_attention
        self.contact_timeout_s = contact_timeout_s
        self.reasoning_parser = reasoning_parser
        self.errors = errors
        #: Every VLLM_BI100_* variable that was set, exactly as given.
        self.raw: Dict[str, str] = dict(raw or {})

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__)
        return f"Settings({fields})"

    def check(self) -> None:
        """Raise ConfigError listing every invalid variable (strict mode)."""
        if self.errors:
            raise ConfigError("; ".join(self.errors))

    @property
    def off(self) -> bool:
        """Nothing to do: the kill switch, or an invalid VLLM_BI100_PATCH."""
        return self.mode in ("0", INVALID)

    @property
    def kill_switch(self) -> bool:
        """VLLM_BI100_PATCH=0, set on purpose."""
        return self.mode == "0"

    def mode_text(self) -> str:
        """``VLLM_BI100_PATCH=<value as given>`` (quoted when it has spaces or is empty)."""
        raw = self.raw.get(MODE)
        if raw is None:
            return f"{MODE} unset (auto)"
        plain = raw and raw.isprintable() and raw.strip() == raw and "'" not in raw
        return f"{MODE}={raw}" if plain else f"{MODE}={raw!r}"


def _int_parser(minimum: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw.strip())
        if value < minimum:
            raise ValueError
        return value

    return parse


def _parse_mode(raw: str) -> str:
    value = raw.strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("0", "1"):
        return value
    raise ValueError


def _parse_bool(raw: str) -> bool:
    value = raw.strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ValueError


def _parse_disabled(raw: str) -> Tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip().lower() for n in raw.split(",") if n.strip()))
    if any(n not in table.names() for n in names):
        raise ValueError
    return names


def _parse_level(raw: str) -> Optional[str]:
    value = raw.strip().upper()
    if value == "":
        return None
    if value not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError
    return value


def _parse_fallback(raw: str) -> Optional[int]:
    value = raw.strip().lower()
    if value in ("", "never"):
        return None
    return _int_parser(0)(value)


def _parse_prompt(raw: str) -> str:
    value = raw.strip().lower()
    if value in ("", PROMPT_AUTO):
        return PROMPT_AUTO
    if value == PROMPT_SHIM:
        return PROMPT_SHIM
    raise ValueError


def _parse_reasoning(raw: str) -> Optional[str]:
    value = raw.strip().lower()
    if value == "":
        return None
    if value not in REASONING_PARSERS:
        raise ValueError
    return value


_PARSERS: Mapping[str, Tuple[str, Callable[[str], object]]] = {
    MODE: ("mode", _parse_mode),
    DISABLE: ("disabled", _parse_disabled),
    STRICT: ("strict", _parse_bool),
    LOG_LEVEL: ("log_level", _parse_level),
    DECODE_FALLBACK_ABOVE: ("decode_fallback_above", _parse_fallback),
    PREFIX_BUDGET_MB: ("prefix_budget_mb", _int_parser(1)),
    SM_COUNT: ("sm_count", _int_parser(1)),
    SM_OCCUPANCY: ("sm_occupancy", _int_parser(1)),
    SUBSCRIPTION: ("subscription", _int_parser(1)),
    V1_MAX_SEQ_LEN: ("v1_max_seq_len", _int_parser(1)),
    DENSE_HEAD_MAX: ("dense_head_max", _int_parser(1)),
    METRICS_INTERVAL: ("metrics_interval_s", _int_parser(0)),
    PROMPT_ATTENTION: ("prompt_attention", _parse_prompt),
    CONTACT_TIMEOUT: ("contact_timeout_s", _int_parser(1)),
    REASONING_PARSER: ("reasoning_parser", _parse_reasoning),
}


def load(environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Parse the environment. Never raises; invalid values are listed in ``errors``."""
    env = os.environ if environ is None else environ
    values: dict = {}
    errors = []
    given = {}
    for var in VARIABLES:
        raw = env.get(var.name)
        if raw is None:
            continue
        given[var.name] = raw
        field, parse = _PARSERS[var.name]
        try:
            values[field] = parse(raw)
        except ValueError:
            if var.name == MODE:
                # A mistyped kill switch must not patch: an invalid mode keeps the shim off.
                values["mode"] = INVALID
                fallback = "the shim stays off"
            else:
                fallback = f"using the default {var.default}"
            accepted = var.accepted.replace("`", "")
            errors.append(f"{var.name}={raw!r} is invalid; accepted: {accepted} ({fallback})")
    return Settings(errors=tuple(errors), raw=given, **values)


def env_table() -> str:
    """The README's table of environment variables, generated from VARIABLES."""
    rows = ["| variable | default | accepted | meaning |", "|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.default} | {v.accepted} | {v.meaning} |" for v in VARIABLES]
    return "\n".join(rows)
