"""The bootstrap in this process, driven through the environment as a server is: every variable
of the README table reaching the patched methods, strict mode, the state after a failed check,
revert, the patched repr, +corex detection, and apply/revert/status from 8 threads."""

from __future__ import annotations

import importlib
import logging
import sys
import threading

import pytest
import torch
from helpers.reference import paged_batch, ref_decode

import vllm_bi100_patch as shim
from vllm_bi100_patch.activation import bootstrap, config
from vllm_bi100_patch.patching import factories, hardware, registry
from vllm_bi100_patch.attention import import_guard
from vllm_bi100_patch.attention.native import decoder as dispatch
from vllm_bi100_patch.attention import paged_attention
from vllm_bi100_patch.patching import strict

PA = "vllm.attention.ops.paged_attn"
HEADS, KV_HEADS, D, BS = 4, 2, 64, 16


@pytest.fixture
def env(monkeypatch):
    for name in [v.name for v in config.VARIABLES]:
        monkeypatch.delenv(name, raising=False)

    def set_env(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return set_env


@pytest.fixture
def server(fake_vllm_factory, env, monkeypatch):
    """A fake vLLM 0.6.3.post1 on sys.path whose native ops count as present; the shim is
    activated from the environment and vLLM's paged_attn imported afterwards (the post-import
    hook patches it), as in a server process."""

    def start(version="0.6.3.post1", **variables):
        fake_vllm_factory(version)
        env(VLLM_BI100_PATCH="1", **variables)
        monkeypatch.setattr(hardware, "ixformer_present", lambda: True)
        bootstrap.bootstrap("sitecustomize")
        return importlib.import_module(PA)

    return start


def _decode_inputs(seq_lens=(37, 1, 16)):
    g = torch.Generator().manual_seed(0)
    kc, vc, bt, _, _ = paged_batch(seq_lens, KV_HEADS, D, BS, 32, 4, g)
    q = torch.randn(len(seq_lens), HEADS, D, generator=g)
    return q, kc, vc, bt, torch.tensor(seq_lens, dtype=torch.int32)


def _decode(pa, max_seq_len=None):
    q, kc, vc, bt, sl = _decode_inputs()
    m = int(sl.max()) if max_seq_len is None else max_seq_len
    out = pa.PagedAttention.forward_decode(q, kc, vc, bt, sl, m, "auto", KV_HEADS, D ** -0.5,
                                           None, 1.0, 1.0)
    ref = ref_decode(q, kc, vc, bt, sl, D ** -0.5)
    # float32 kernels vs float64 reference: measured max error 4.8e-7 (native fake and
    # fallback alike); 10x margin.
    torch.testing.assert_close(out.double(), ref, atol=5e-6, rtol=0)
    counts = dispatch.route_counts()
    return max(counts, key=lambda k: counts[k])


# ------------------------------------------------ every README variable, through the environment

# 3 sequences x 4 heads = 12 CTAs; max_seq_len 2000 = 4 partitions. V1 when 12 >= SM count x
# occupancy x subscription (the BI-V100 rule), else V2. Each row moves one variable across 12.
ROUTING = [
    ({}, "native_v2"),                                                     # 16 x 1 x 5 = 80
    ({config.SM_COUNT: "2"}, "native_v1"),                                 # 2 x 1 x 5 = 10
    ({config.SM_COUNT: "1", config.SM_OCCUPANCY: "2"}, "native_v1"),       # 10
    ({config.SM_COUNT: "1", config.SM_OCCUPANCY: "3"}, "native_v2"),       # 15
    ({config.SM_COUNT: "3", config.SUBSCRIPTION: "4"}, "native_v1"),       # 12
    ({config.SM_COUNT: "3", config.SUBSCRIPTION: "5"}, "native_v2"),       # 15
]


@pytest.mark.parametrize("variables,route", ROUTING, ids=[str(v) for v, _ in ROUTING])
def test_routing_variables_reach_the_patched_decode(server, variables, route):
    pa = server(**variables)
    assert _decode(pa, max_seq_len=2000) == route


@pytest.mark.parametrize("threshold,route", [("0", "fallback"), ("30", "fallback"),
                                             ("37", "native_v1"), ("never", "native_v1")])
def test_fallback_above_reaches_the_patched_decode(server, threshold, route):
    pa = server(**{config.DECODE_FALLBACK_ABOVE: threshold})  # longest sequence: 37
    assert _decode(pa) == route


def test_prefix_budget_reaches_the_patched_prefix(server, monkeypatch):
    seen = []
    real = paged_attention.paged_prefix

    def spy(*args, **kwargs):
        seen.append(kwargs["budget_mb"])
        return real(*args, **kwargs)

    monkeypatch.setattr(paged_attention, "paged_prefix", spy)
    pa = server(**{config.PREFIX_BUDGET_MB: "7"})
    q, kc, vc, bt, sl = _decode_inputs()
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    k = torch.randn(3, KV_HEADS, D)
    pa.PagedAttention.forward_prefix(q, k, k, "auto", kc, vc, bt, qsl, sl, sl - 1, 1, None,
                                     None, 1.0, 1.0)
    assert seen == [7]


@pytest.mark.parametrize("disabled,patched,guard", [
    ("decode", ["forward_prefix"], True),
    ("prefix", ["forward_decode"], True),
    ("import_guard", ["forward_decode", "forward_prefix"], False),
    ("decode,prefix", [], True),
])
def test_disable_through_the_environment(server, disabled, patched, guard):
    pa = server(**{config.DISABLE: disabled})
    assert sorted(shim.status()["patched"]) == patched
    for name in ("forward_decode", "forward_prefix"):
        assert registry.is_ours(vars(pa.PagedAttention)[name]) is (name in patched)
    assert import_guard.installed() is guard
    prefix = sys.modules.get(import_guard.TARGET)
    assert import_guard.is_substitute(prefix) is guard


@pytest.mark.parametrize("level,info,debug", [("DEBUG", True, True), ("INFO", True, False),
                                              ("WARNING", False, False)])
def test_log_level_takes_effect(server, caplog, level, info, debug):
    caplog.set_level(logging.DEBUG)  # the root handler takes everything the logger passes on
    logging.getLogger("vllm.bi100_patch").setLevel(logging.NOTSET)
    server(**{config.LOG_LEVEL: level})
    assert logging.getLogger("vllm.bi100_patch").level == getattr(logging, level)
    messages = [r.getMessage() for r in caplog.records if r.name == "vllm.bi100_patch"]
    assert any("vllm-bi100-patch active" in m for m in messages) is info
    assert any("served the substitute" in m for m in messages) is debug


def test_mode_off_and_invalid_through_the_environment(fake_vllm_factory, env):
    fake_vllm_factory("0.6.3.post1")
    for value, decision in [("0", "off: VLLM_BI100_PATCH=0 (kill switch)"),
                            ("2", "off: VLLM_BI100_PATCH=2 is invalid")]:
        env(VLLM_BI100_PATCH=value)
        st = shim.apply()
        assert st["decision"].startswith(decision) and st["active"] is False
        pa = importlib.import_module(PA)
        assert not registry.is_ours(vars(pa.PagedAttention)["forward_decode"])
        shim.revert()


# ------------------------------------------------------------------------------- strict mode

def test_apply_strict_raises_on_an_unsupported_version(fake_vllm_factory, env):
    fake_vllm_factory("0.4.0")
    env(VLLM_BI100_PATCH="1")
    with pytest.raises(strict.PatchError, match="0.4.0 is not a supported version"):
        shim.apply(strict=True)


def test_apply_strict_raises_on_a_failed_code_check(paged_attn_module, env):
    from vllm_bi100_patch.patching import versions

    fam = versions.family_for(versions.VersionInfo("0.6.3"))
    renamed = tuple("seqlens" if p == "seq_lens" else p for p in fam.decode_params)
    paged_attn_module("0.6.3", decode_params=renamed)
    env(VLLM_BI100_PATCH="1")
    with pytest.raises(strict.PatchError, match="does not match"):
        shim.apply(strict=True)


def test_apply_strict_raises_on_an_invalid_variable(fake_vllm_factory, env):
    fake_vllm_factory("0.6.3.post1")
    env(VLLM_BI100_PATCH="1", VLLM_BI100_SM_COUNT="many")
    with pytest.raises(config.ConfigError, match="VLLM_BI100_SM_COUNT='many'"):
        shim.apply(strict=True)
    shim.revert()
    assert shim.apply(strict=False)["config_errors"]  # lenient: reported, not raised


def test_strict_environment_fails_the_vllm_import_not_the_start(fake_vllm_factory, env):
    fake_vllm_factory("0.6.3.post1")
    env(VLLM_BI100_PATCH="1", VLLM_BI100_PATCH_STRICT="1", VLLM_BI100_SM_COUNT="many")
    bootstrap.bootstrap("sitecustomize")  # interpreter start: never raises
    bootstrap.bootstrap("pth")
    for _ in range(2):  # every attempt to import vLLM fails, with the same one message
        with pytest.raises(config.ConfigError, match="VLLM_BI100_PATCH_STRICT=1"):
            importlib.import_module("vllm")


# -------------------------------------------------------- state after a failed check / error

def test_failed_code_check_keeps_the_guard_on_purpose_and_says_so(fake_vllm_factory, env,
                                                                  caplog):
    from vllm_bi100_patch.patching import versions

    fam = versions.family_for(versions.VersionInfo("0.6.3"))
    renamed = tuple("seqlens" if p == "seq_lens" else p for p in fam.decode_params)
    env(VLLM_BI100_PATCH="1")
    caplog.set_level(logging.WARNING)
    fake_vllm_factory("0.6.3", decode_params=renamed)
    shim.apply()
    pa = importlib.import_module(PA)
    st = shim.status()
    assert st["patched"] == [] and st["import_guard"]["installed"] is True
    assert st["decision"].startswith("not patched: vLLM 0.6.3 is in the range of family v0.5.5")
    assert "the import guard stays on on purpose" in st["decision"]
    warning = [r.getMessage() for r in caplog.records if "does not match" in r.getMessage()]
    assert len(warning) == 1 and "stays on on purpose" in warning[0]
    assert "stock vLLM runs" not in warning[0]
    with pytest.raises(import_guard.TritonPrefixBlocked):
        pa.PagedAttention.forward_prefix(*range(15))


def test_failed_code_check_without_the_guard_says_stock_vllm_runs(fake_vllm_factory, env):
    from vllm_bi100_patch.patching import versions

    fam = versions.family_for(versions.VersionInfo("0.6.3"))
    renamed = tuple("seqlens" if p == "seq_lens" else p for p in fam.decode_params)
    env(VLLM_BI100_PATCH="1", VLLM_BI100_PATCH_DISABLE="import_guard")
    fake_vllm_factory("0.6.3", decode_params=renamed)
    shim.apply()
    importlib.import_module(PA)
    st = shim.status()
    assert st["decision"].endswith("no import guard, stock vLLM runs")
    assert st["import_guard"]["installed"] is False


def test_exception_while_patching_is_reported_with_the_guard_state(fake_vllm_factory, env,
                                                                  monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("factory exploded")

    monkeypatch.setattr(paged_attention, "make_prefix_wrapper", boom)
    fake_vllm_factory("0.6.3.post1")
    env(VLLM_BI100_PATCH="1")
    shim.apply()
    importlib.import_module(PA)
    st = shim.status()
    assert st["patched"] == []
    assert "patching failed and was rolled back (RuntimeError: factory exploded)" in st["decision"]
    assert "the import guard stays on on purpose" in st["decision"]


# ------------------------------------------------------------------------------------ revert

def test_revert_restores_what_the_readme_promises(fake_vllm_factory, env):
    fake_vllm_factory("0.6.3.post1")
    env(VLLM_BI100_PATCH="1")
    meta_before = list(sys.meta_path)
    shim.apply()
    pa = importlib.import_module(PA)  # imports the substitute prefix_prefill
    originals = {n: registry.get_original(pa.PagedAttention, n)
                 for n in ("forward_decode", "forward_prefix")}
    assert vars(pa)["context_attention_fwd"] is import_guard.context_attention_fwd
    st = shim.revert()
    assert st["active"] is False and st["patched"] == []
    assert st["decision"].startswith("reverted")
    assert sys.meta_path == meta_before  # post-import hook and import guard both gone
    for name, desc in originals.items():
        assert vars(pa.PagedAttention)[name] is desc
    assert "context_attention_fwd" not in vars(pa)  # the substitute is unbound ...
    assert import_guard.TARGET not in sys.modules  # ... and out of sys.modules
    assert "prefix_prefill" not in vars(sys.modules["vllm.attention.ops"])
    real = importlib.import_module(import_guard.TARGET)  # the next import is the real one
    assert not import_guard.is_substitute(real)
    assert shim.apply()["patched"] == ["forward_decode", "forward_prefix"]


def test_revert_gives_back_real_references_it_had_repointed(fake_vllm_factory, env):
    fake_vllm_factory("0.6.3.post1")
    pa = importlib.import_module(PA)  # real Triton module imported before the shim
    real = vars(pa)["context_attention_fwd"]
    env(VLLM_BI100_PATCH="1")
    shim.apply()
    assert vars(pa)["context_attention_fwd"] is import_guard.context_attention_fwd
    shim.revert()
    assert vars(pa)["context_attention_fwd"] is real
    assert sys.modules[import_guard.TARGET].context_attention_fwd is real


# -------------------------------------------------------------------------------- operator view

def test_patched_method_says_what_it_is(server):
    pa = server()
    text = repr(pa.PagedAttention.forward_decode)
    assert text.startswith("<vllm-bi100-patch wrapper of PagedAttention.forward_decode "
                           "(vLLM 0.6.3.post1, family v0.5.5), wrapping <function "
                           "PagedAttention.forward_decode at ")
    assert str(pa.PagedAttention.forward_prefix).startswith(
        "<vllm-bi100-patch wrapper of PagedAttention.forward_prefix")
    # everything vLLM looks at is still the original's
    assert pa.PagedAttention.forward_decode.__name__ == "forward_decode"
    assert pa.PagedAttention.forward_decode.__module__ == PA
    shim.revert()
    assert "vllm-bi100-patch" not in repr(pa.PagedAttention.forward_decode)


def test_corex_torch_is_detected_and_auto_mode_arms(fake_vllm_factory, env, tmp_path,
                                                    monkeypatch):
    fake_vllm_factory("0.6.3.post1")
    env(VLLM_BI100_PATCH="auto")
    assert hardware.torch_is_corex() is False
    bootstrap.activate("sitecustomize")
    assert bootstrap.state()["decision"].startswith("off: VLLM_BI100_PATCH=auto and no Iluvatar")
    (tmp_path / "torch-2.1.0+corex.3.2.3.dist-info").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert hardware.torch_is_corex() is True
    assert hardware.cheap_detection() == {"ixformer": False, "torch_corex": True}
    bootstrap.activate("sitecustomize")
    pa = importlib.import_module(PA)
    assert registry.is_ours(vars(pa.PagedAttention)["forward_decode"])


# ------------------------------------------------------------------------------------ threads

def _run_threads(target, n=8):
    """Run ``target(i)`` for i < n in n threads at once, switching between them as often as
    the interpreter allows (so that races show)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)


def test_apply_revert_status_from_eight_threads(fake_vllm_factory, env):
    fake_vllm_factory("0.6.3.post1")
    env(VLLM_BI100_PATCH="1")
    pa = importlib.import_module(PA)
    originals = {n: vars(pa.PagedAttention)[n] for n in ("forward_decode", "forward_prefix")}
    errors = []
    start = threading.Barrier(8)

    def work(i):
        try:
            start.wait()
            for j in range(150):
                step = (i + j) % 3
                if step == 0:
                    shim.apply()
                elif step == 1:
                    shim.revert()
                else:
                    st = shim.status()
                    # a snapshot is never half an apply or half a revert
                    assert st["patched"] in ([], ["forward_decode", "forward_prefix"]), st
                    assert (st["patched"] != []) <= st["active"], st
        except BaseException as exc:  # noqa: B902 - reported below
            errors.append(exc)

    _run_threads(work)
    assert errors == []
    st = shim.apply()  # whatever the interleaving, apply works afterwards ...
    assert st["active"] and st["patched"] == ["forward_decode", "forward_prefix"]
    st = shim.revert()  # ... and revert gives back the very originals
    assert st["patched"] == [] and not st["active"]
    for name, desc in originals.items():
        assert vars(pa.PagedAttention)[name] is desc


def test_route_counters_lose_no_update_across_threads():
    dispatch.reset_route_counts()
    _run_threads(lambda i: [dispatch._count_route("fallback") for _ in range(20000)])
    assert dispatch.route_counts()["fallback"] == 8 * 20000
    factories.reset_call_counts()
    assert dispatch.route_counts()["fallback"] == 0
