"""The substitute for vLLM's Triton prefix module refuses loudly and names its caller."""

import importlib
import sys

import pytest

from vllm_bi100_patch.attention import import_guard


@pytest.fixture
def guard(fake_vllm_factory):
    fake_vllm_factory("0.6.3.post1")
    import_guard.install()
    yield
    import_guard.uninstall()


def _stock_prefix_call(pa):
    return pa.PagedAttention.forward_prefix(*range(15))


def test_substitute_is_served_and_refuses_naming_the_caller(guard):
    pa = importlib.import_module("vllm.attention.ops.paged_attn")
    pp = sys.modules[import_guard.TARGET]
    assert import_guard.is_substitute(pp)
    assert "_fake_triton_log" not in sys.modules  # the real module never ran
    with pytest.raises(import_guard.TritonPrefixBlocked) as err:
        _stock_prefix_call(pa)  # stock forward_prefix -> context_attention_fwd
    message = str(err.value)
    assert "vllm.attention.ops.paged_attn.forward_prefix" in message
    assert "VLLM_BI100_PATCH_DISABLE" in message and "VLLM_BI100_PATCH=0" in message
    with pytest.raises(AttributeError, match="substitute"):
        pp.some_triton_kernel  # noqa: B018


def test_real_module_imported_first_is_neutralised_and_restored(fake_vllm_factory):
    fake_vllm_factory("0.6.3.post1")
    pa = importlib.import_module("vllm.attention.ops.paged_attn")
    real = pa.context_attention_fwd
    assert not import_guard.is_substitute(sys.modules[import_guard.TARGET])
    import_guard.install()
    try:
        assert pa.context_attention_fwd is import_guard.context_attention_fwd
        assert import_guard.state() == {"installed": True, "prefix_prefill": "real (Triton)"}
    finally:
        import_guard.uninstall()
    assert pa.context_attention_fwd is real
    assert not import_guard.installed()


def test_install_is_idempotent(guard):
    import_guard.install()
    assert sum(isinstance(f, import_guard.PrefixPrefillGuard) for f in sys.meta_path) == 1
    assert sys.meta_path[0].__class__ is import_guard.PrefixPrefillGuard
