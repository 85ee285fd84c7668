"""The activation's one state object, strict mode's one raise-or-log rule, and the one decision
made once per activation (issue 15)."""

from __future__ import annotations

import importlib
import logging
import os
import re

import pytest

import vllm_bi100_patch as shim
from vllm_bi100_patch.activation import bootstrap, config
from vllm_bi100_patch.patching import decision, strict
from vllm_bi100_patch.activation import phase

PA = "vllm.attention.ops.paged_attn"
PACKAGE = os.path.dirname(shim.__file__)


@pytest.fixture
def env(monkeypatch):
    for name in [v.name for v in config.VARIABLES]:
        monkeypatch.delenv(name, raising=False)
    return lambda **values: [monkeypatch.setenv(k, v) for k, v in values.items()]


def _phase():
    return bootstrap._state.phase


def test_each_phase_is_what_status_says(fake_vllm_factory, env):
    """status()["decision"] is derived from the one state: its phase's value, then the detail."""
    assert _phase() is phase.Phase.NOT_BOOTSTRAPPED
    assert shim.status()["decision"] == "not bootstrapped"
    seen = []

    def record():
        st = shim.status()
        assert st["decision"] == bootstrap._state.text()
        assert st["decision"].split(":")[0] == _phase().value
        assert st["active"] is (_phase() in phase.ACTIVE)
        seen.append(_phase())

    env(VLLM_BI100_PATCH="0")
    bootstrap.bootstrap("sitecustomize")
    record()
    fake_vllm_factory("0.6.3.post1")
    env(VLLM_BI100_PATCH="1")
    shim.apply()
    record()
    importlib.import_module(PA)
    record()
    shim.revert()
    record()
    fake_vllm_factory("0.4.0")
    shim.apply()
    importlib.import_module("vllm")
    record()
    P = phase.Phase
    assert seen == [P.OFF, P.ARMED, P.PATCHED, P.REVERTED, P.NOT_PATCHED]


def test_the_decision_is_made_once_per_activation(fake_vllm_factory, env, monkeypatch):
    """Start-up, the version hook, every target module's apply and apply(strict=True) share
    one decide() call; the later stages refine it."""
    calls = []
    real = decision.decide

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(decision, "decide", counting)
    fake_vllm_factory("0.6.3.post1")
    env(VLLM_BI100_PATCH="1")
    bootstrap.bootstrap("sitecustomize")
    importlib.import_module(PA)
    st = shim.apply(strict=True)
    assert "forward_decode" in st["patched"] and st["decision"].startswith("patched: ")
    assert len(calls) == 1, calls
    shim.revert()  # a new activation decides again, once
    shim.apply()
    assert len(calls) == 2


def test_strict_raises_the_error_it_is_given_else_warns_once(caplog):
    with pytest.raises(strict.PatchError, match="^bad version$"):
        strict.raise_or_log("bad version", True)
    with pytest.raises(config.ConfigError, match="X=1"):
        strict.raise_or_log("X=1 is invalid", True, error=config.ConfigError)
    failure = KeyError("k")
    with pytest.raises(KeyError) as info:
        strict.raise_or_log("patching failed", True, exc=failure)
    assert info.value is failure  # the failure itself, not a wrapped copy
    with caplog.at_level(logging.WARNING, logger="vllm.bi100_patch"):
        for _ in range(3):
            strict.raise_or_log("bad version", False)
            strict.raise_or_log("joined", False, warnings=["a=1 bad", "b=2 bad"])
        strict.raise_or_log("patching failed", False, exc=failure, traceback=True)
    lines = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert lines == [("WARNING", "vllm-bi100-patch: bad version", False),
                     ("WARNING", "vllm-bi100-patch: a=1 bad", False),
                     ("WARNING", "vllm-bi100-patch: b=2 bad", False),
                     ("ERROR", "vllm-bi100-patch: patching failed", True)]


def test_only_the_strict_module_raises_for_strict_mode():
    """No other module decides between raising and logging: PatchError/ConfigError are raised
    in strict.py alone (and by Settings.check, which callers ask to raise), and no module
    branches on a strict flag to raise."""
    allowed = {'activation/config.py: raise ConfigError("; ".join(self.errors))'}  # Settings.check()
    pattern = re.compile(r"raise [\w.]*(PatchError|ConfigError)\(.*"
                         r"|if [\w.]*strict[\w.]*:\s*\n\s*raise.*")
    offenders = []
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            path = os.path.join(folder, name)
            if not name.endswith(".py") or os.path.samefile(path, strict.__file__):
                continue
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
            rel = os.path.relpath(path, PACKAGE)
            offenders += [f"{rel}: {m.group(0).strip()}" for m in pattern.finditer(text)]
    assert [o for o in offenders if o not in allowed] == []
