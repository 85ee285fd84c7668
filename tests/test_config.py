"""Every environment variable: defaults, valid values, invalid values named clearly."""

import pytest

from vllm_bi100_patch import config


def test_defaults():
    s = config.load({})
    assert (s.mode, s.disabled, s.strict, s.decode_fallback_above, s.prefix_budget_mb) == (
        "auto", (), False, None, 256)
    assert s.errors == () and not s.off


@pytest.mark.parametrize("raw,mode", [("0", "0"), ("off", "0"), ("1", "1"), ("TRUE", "1"),
                                      ("auto", "auto"), ("", "auto")])
def test_mode(raw, mode):
    assert config.load({config.MODE: raw}).mode == mode


def test_invalid_mode_means_off_and_is_reported():
    s = config.load({config.MODE: "disable"})
    assert s.off
    assert s.errors and config.MODE in s.errors[0] and "stays off" in s.errors[0]
    with pytest.raises(config.ConfigError, match=config.MODE):
        s.check()


def test_disabled_list():
    s = config.load({config.DISABLE: " Prefix , import_guard,prefix"})
    assert s.disabled == ("prefix", "import_guard")
    bad = config.load({config.DISABLE: "prefix,bogus"})
    assert bad.disabled == () and "decode" in bad.errors[0] and config.DISABLE in bad.errors[0]


@pytest.mark.parametrize("var,raw", [(config.PREFIX_BUDGET_MB, "0"), (config.PREFIX_BUDGET_MB, "x"),
                                     (config.DECODE_FALLBACK_ABOVE, "-1"),
                                     (config.SM_COUNT, "0"), (config.STRICT, "maybe"),
                                     (config.LOG_LEVEL, "LOUD")])
def test_invalid_values_named(var, raw):
    s = config.load({var: raw})
    assert len(s.errors) == 1 and var in s.errors[0] and repr(raw) in s.errors[0]


def test_fallback_threshold():
    assert config.load({config.DECODE_FALLBACK_ABOVE: "0"}).decode_fallback_above == 0
    assert config.load({config.DECODE_FALLBACK_ABOVE: "never"}).decode_fallback_above is None
    assert config.load({config.DECODE_FALLBACK_ABOVE: "32768"}).decode_fallback_above == 32768


def test_env_table_documents_every_variable():
    table = config.env_table()
    for var in config.VARIABLES:
        assert f"`{var.name}`" in table
