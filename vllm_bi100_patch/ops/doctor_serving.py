"""doctor's sections on the OpenAI front end of vLLM 0.5.x - 0.6.4: guided decoding (which
backend works here, what the shim's ``guided_decoding_imports`` row does, whether the installed
``pyairports`` is the delisted airport-data package; docs/serving-compat.md, "Guided decoding";
docs/operating.md) and today's clients beyond chat completions (``client_checks``: the
Responses API route, reasoning output).

Imports vLLM's guided-decoding backends (and with them outlines or lm-format-enforcer), as a
server's engine does for its first guided request.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
from typing import Dict, List, Optional, Tuple

from ..activation import config
from ..serving import guided_imports
from ..patching import versions

Check = Tuple[str, str, str]
BACKENDS = (("outlines", "vllm.model_executor.guided_decoding.outlines_decoding"),
            ("lm-format-enforcer", "vllm.model_executor.guided_decoding."
                                   "lm_format_enforcer_decoding"))


def applies(info: versions.VersionInfo) -> bool:
    """Whether this vLLM builds guides with outlines 0.0.x (the section is shown)."""
    release = tuple(info.release[:3]) if info.release is not None else None
    low, high = guided_imports.VLLM_RANGE
    return release is not None and low <= release < high


def pyairports_check() -> Check:
    """The installed ``pyairports``: absent, the real package, or an impostor named so."""
    try:
        dist = md.distribution("pyairports")
    except md.PackageNotFoundError:
        return ("info", "pyairports", "not installed")
    files = [str(f) for f in dist.files or ()]
    if "pyairports/airports.py" in files:
        return ("ok", "pyairports", f"{dist.version}: provides pyairports.airports")
    tops = sorted({f.split("/", 1)[0] for f in files if "/" in f and not f.split("/", 1)[0]
                   .endswith((".dist-info", ".egg-info", ".data", "__pycache__"))
                   and f.endswith(".py")})
    scripts = [e.name for e in dist.entry_points if e.group == "console_scripts"]
    what = (f"installs top-level {', '.join(tops)}" if tops else "installs no module")
    if scripts:
        what += f" and the console script(s) {', '.join(scripts)}"
    return ("WARN", "pyairports", f"{dist.version} is not the delisted airport-data package: "
            f"it has no pyairports.airports ({what}); PyPI's pyairports is an unrelated "
            "upload since 2025 (vLLM issue #23983) that every fresh install of vLLM 0.6.x "
            "pulls in; outlines cannot import without pyairports.airports")


def _row_check(settings: config.Settings) -> Check:
    row = guided_imports.ROW
    if settings.off:
        return ("info", row, "the shim is off: nothing supplied")
    if row in settings.disabled:
        return ("info", row, f"disabled by {config.DISABLE}: nothing supplied")
    why = guided_imports.why_not()
    if why is not None:
        return ("info", row, f"would not answer: {why}")
    return ("ok", row, "supplies pyairports.airports (AIRPORT_LIST = [], what outlines "
            "imports; no JSON schema, regex or choice refers to it) where no real one is "
            "installed, with one WARNING")


def _backend(module: str) -> Optional[str]:
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - what the engine would meet
        return f"{type(exc).__name__}: {exc}"
    return None


def guided_checks(settings: config.Settings) -> List[Check]:
    """The section's checks: the pyairports installed, the row, each backend imported as the
    engine imports it (behind the row's finder where the shim would install it)."""
    checks = [pyairports_check(), _row_check(settings)]
    if not settings.off and guided_imports.ROW not in settings.disabled:
        guided_imports.install()  # as activation does in a server's processes
    working = []
    for name, module in BACKENDS:
        problem = _backend(module)
        if problem is None:
            supplied = [m for m in guided_imports.state()["supplied"]
                        if name == "outlines"]
            working.append(name)
            checks.append(("ok", name, "imports" + (" (with the shim's pyairports.airports)"
                                                    if supplied else "")))
        else:
            checks.append(("WARN", name, f"cannot be built: {problem}"))
    checks.append(("info", "backend", "vLLM's default is outlines (--guided-decoding-backend; "
                   "a request's guided_decoding_backend overrides it); working here: "
                   + (", ".join(working) or "none: every guided request is refused with a "
                      "400 naming the cause (row guided_decoding_errors)")))
    checks.append(("info", "ChatCompletionRequest", "a server replaces it wherever vLLM "
                   "bound it when the shim activates; status()['class_bindings'] lists where, "
                   "and the routes of an app built before activation it cannot reach"))
    return checks


#: The rows of today's clients' routes and outputs (docs/serving-compat.md).
CLIENT_ROWS = ("responses_api", "reasoning_flags", "reasoning_parser", "reasoning_output",
               "reasoning_stream")


def client_checks(settings: config.Settings, applied: List[str],
                  skipped: Dict[str, str]) -> List[Check]:
    """doctor's lines on what today's clients ask of a 0.6.x server beyond chat completions:
    the Responses API route and reasoning output, from the code checks' report (``applied``,
    ``skipped``: row -> why)."""
    def state(row: str) -> str:
        if row in applied:
            return "applied"
        return skipped.get(row, "not applied (its vLLM module was not imported)")

    checks: List[Check] = []
    if "responses_api" in applied:
        checks.append(("ok", "/v1/responses", "served by row responses_api on every app "
                       "build_app builds: stateless (store answered false; "
                       "previous_response_id, background, hosted tools refused by name); "
                       "docs/serving-compat.md, \"The Responses API\""))
    else:
        checks.append(("info", "/v1/responses", state("responses_api")))
    rows = [r for r in CLIENT_ROWS[1:] if r not in applied]
    parser = settings.reasoning_parser
    if rows:
        checks.append(("info", "reasoning output", "not served: " + "; ".join(
            f"{r}: {state(r)}" for r in rows)))
    elif parser:
        checks.append(("ok", "reasoning output", f"{config.REASONING_PARSER}={parser}: "
                       "every OpenAI app in a server process returns the thinking as "
                       "reasoning_content (a --reasoning-parser flag wins)"))
    else:
        checks.append(("info", "reasoning output", "off, as upstream: `vllm serve ... "
                       "--enable-reasoning --reasoning-parser " + "|".join(
                           config.REASONING_PARSERS) + f"` (or {config.REASONING_PARSER}) "
                       "returns a reasoning model's thinking as reasoning_content"))
    return checks
