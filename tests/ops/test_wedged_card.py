"""A wedged card, on CPU: a fake torch (``tests/fakes/wedged_torch``) whose
``torch.cuda.mem_get_info()`` never returns and which ignores SIGTERM, first on the
``PYTHONPATH`` of ``selftest`` and ``doctor`` run as an operator runs them (fresh interpreters).
Each must give up after the contact time-out, stop the probe's process group for real, print
the one line naming the state and exit 5 (``selftest.contact.EXIT_WEDGED``), within a bounded
wall time. The healthy path is every other selftest and doctor test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from helpers.shim import ROOT

from vllm_bi100_patch.ops.selftest import child, contact

WEDGED = os.path.join(ROOT, "tests", "fakes", "wedged_torch")
CONTACT_S = 2
#: The contact time-out, the probe's SIGTERM grace (1 s) and a loaded 2-core machine's
#: interpreter starts: far below a hang, far above a healthy probe's stop.
BOUND_S = 30


def _cli(tmp_path, *args, extra_path=()):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_BI100", "PYTHONPATH"))}
    env.update(PYTHONPATH=os.pathsep.join([WEDGED, ROOT, *extra_path]),
               VLLM_BI100_CONTACT_TIMEOUT_S=str(CONTACT_S),
               WEDGED_TORCH_PID_FILE=str(tmp_path / "probe.pid"))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "vllm_bi100_patch", *args], env=env,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    return proc, time.monotonic() - start


def _assert_probe_gone(tmp_path):
    pid = int((tmp_path / "probe.pid").read_text())  # the fake reached mem_get_info
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _assert_the_line(line, tool):
    assert line.startswith(f"vllm-bi100-patch {tool}: WEDGED CARD: cuda:0 did not answer "
                           f"within {CONTACT_S} s (torch.cuda.mem_get_info() never returned; "
                           "torch.cuda.is_available(), torch.cuda.device_count(), "
                           "torch.cuda.get_device_properties() answered)"), line
    assert "only by a host restart" in line and "--gpu-reset returns 255" in line
    assert 'docs/operating.md, "A wedged card"' in line


def test_selftest_gives_up_on_a_card_that_never_answers(tmp_path):
    proc, wall = _cli(tmp_path, "selftest", "--device", "cuda", "--json", "--json-out",
                      str(tmp_path / "out.json"))
    assert proc.returncode == contact.EXIT_WEDGED == 5, proc.stderr
    assert wall < BOUND_S, wall
    lines = [ln for ln in proc.stderr.splitlines() if "WEDGED CARD" in ln]
    assert len(lines) == 1, proc.stderr
    _assert_the_line(lines[0], "selftest")
    out = json.loads(proc.stdout)
    assert out["ok"] is False and out["wedged"]["wedged"] is True
    assert out["wedged"]["during"] == "first contact"
    assert out["wedged"]["stages"][-1] == "torch.cuda.mem_get_info()"
    assert out["wedged"]["facts"]["name"] == "Iluvatar BI-V100 (a wedged stand-in)"
    assert json.loads((tmp_path / "out.json").read_text()) == out
    _assert_probe_gone(tmp_path)


def test_doctor_reports_the_wedged_card_and_exits_5(tmp_path):
    corex = tmp_path / "corex_site"  # a CoreX torch's dist-info: a device may exist here
    (corex / "torch-2.1.0+corex.3.2.3.dist-info").mkdir(parents=True)
    proc, wall = _cli(tmp_path, "doctor", extra_path=[str(corex)])
    assert proc.returncode == contact.EXIT_WEDGED, proc.stdout + proc.stderr
    assert wall < BOUND_S, wall
    out = proc.stdout.splitlines()
    assert any(ln.startswith("  [FAIL] device (first contact): WEDGED CARD: cuda:0 did not "
                             "answer") for ln in out), proc.stdout
    assert out[-2].startswith("verdict: ")  # every section and the verdict still printed
    _assert_the_line(out[-1], "doctor")
    _assert_probe_gone(tmp_path)


def test_the_child_runner_stops_the_whole_group_and_never_waits_on_it(tmp_path):
    """A child that ignores SIGTERM and starts a grandchild: both end at the time-out."""
    pid_file = tmp_path / "grandchild.pid"
    code = ("import signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "time.sleep(600)\n")
    start = time.monotonic()
    ended = child.run([sys.executable, "-c", code], 3.0, grace_s=0.5)
    assert ended.timed_out and ended.returncode is None and not ended.lingering
    assert time.monotonic() - start < 3.0 + 0.5 + child.REAP_S + 1
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5  # the grandchild's parent (init) reaps it
    while time.monotonic() < deadline:
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the grandchild outlived the time-out")
