"""A command in a child process of its own, under a hard time-out: the one way the shim's tools
touch a device that may never answer (a wedged card: ``docs/operating.md``).

- the child leads a new session (its own process group), so a time-out ends it and whatever it
  started, never the caller's group;
- no pipes: the child writes to the files it is given (the caller's own stdout/stderr, or a
  temporary file), so nothing can fill a pipe and block it, and the parent never reads while
  the child writes;
- at the time-out the group gets SIGTERM, then SIGKILL after ``grace_s``; the parent waits at
  most a few seconds more for the exit and then returns anyway (a process blocked inside a
  driver call can outlive SIGKILL: the caller is told, ``Ended.lingering``, and goes on).

Needs no torch and imports nothing of the shim.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from typing import IO, Mapping, Optional, Sequence, Union

__all__ = ["Ended", "run"]

#: Seconds the parent waits for the exit after SIGKILL before it gives up on the child.
REAP_S = 5.0

File = Union[int, IO[str], IO[bytes], None]


@dataclasses.dataclass(frozen=True)
class Ended:
    """How the child ended: its exit status (None: it was stopped at the time-out), the
    seconds waited, and whether it was still alive when the parent stopped waiting."""

    returncode: Optional[int]
    seconds: float
    timed_out: bool
    lingering: bool = False


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run(argv: Sequence[str], timeout_s: float, *, stdout: File = None, stderr: File = None,
        env: Optional[Mapping[str, str]] = None, grace_s: float = 2.0) -> Ended:
    """Run ``argv`` in a new process group; stop the group after ``timeout_s`` seconds."""
    start = time.monotonic()
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=stdout,
                            stderr=stderr, env=None if env is None else dict(env),
                            start_new_session=True)
    try:
        code = proc.wait(timeout=timeout_s)
        return Ended(code, time.monotonic() - start, False)
    except subprocess.TimeoutExpired:
        pass
    except BaseException:  # Ctrl-C in the parent: the child's group goes too
        _stop(proc, grace_s)
        raise
    waited = time.monotonic() - start
    lingering = _stop(proc, grace_s)
    return Ended(None, waited, True, lingering)


def _stop(proc: "subprocess.Popen[bytes]", grace_s: float) -> bool:
    """SIGTERM to the group, SIGKILL after ``grace_s``; True when it is still alive after
    ``REAP_S`` more seconds (the parent stops waiting for it)."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)  # the group: a grandchild of a dead leader too
    try:
        proc.wait(timeout=REAP_S)
    except subprocess.TimeoutExpired:
        return True
    return False
