"""Every environment variable: defaults, valid values, invalid values named clearly."""

import pytest

from vllm_bi100_patch.activation import config


def test_defaults():
    s = config.load({})
    assert (s.mode, s.disabled, s.strict, s.decode_fallback_above, s.prefix_budget_mb) == (
        "auto", (), False, None, 256)
    assert s.errors == () and not s.off


@pytest.mark.parametrize("raw,mode", [("0", "0"), (" 0 ", "0"), ("1", "1"), ("auto", "auto"),
                                      ("AUTO", "auto"), ("", "auto")])
def test_mode_accepts_exactly_the_documented_values(raw, mode):
    s = config.load({config.MODE: raw})
    assert s.mode == mode and s.errors == ()
    assert s.raw == {config.MODE: raw}


@pytest.mark.parametrize("raw", ["2", "yes", "on", "true", "no", "off", "false", "disable", "01"])
def test_other_mode_values_are_invalid_keep_the_shim_off_and_are_quoted(raw):
    s = config.load({config.MODE: raw})
    assert s.mode == config.INVALID and s.off and not s.kill_switch
    assert len(s.errors) == 1
    assert s.errors[0].startswith(f"{config.MODE}={raw!r} is invalid; accepted: auto, 1, 0")
    assert "stays off" in s.errors[0]
    assert s.mode_text() == f"{config.MODE}={raw}"
    with pytest.raises(config.ConfigError, match=config.MODE):
        s.check()


def test_kill_switch_is_only_zero():
    assert config.load({config.MODE: "0"}).kill_switch
    assert config.load({config.MODE: "0"}).mode_text() == f"{config.MODE}=0"
    assert not config.load({config.MODE: "false"}).kill_switch
    assert config.load({}).mode_text() == f"{config.MODE} unset (auto)"


@pytest.mark.parametrize("raw,value", [("1", True), ("0", False), ("", False), (" 1", True)])
def test_strict_accepts_zero_and_one(raw, value):
    s = config.load({config.STRICT: raw})
    assert s.strict is value and s.errors == ()


@pytest.mark.parametrize("raw", ["true", "yes", "on", "no", "2"])
def test_strict_rejects_other_booleans(raw):
    s = config.load({config.STRICT: raw})
    assert s.strict is False and s.errors and repr(raw) in s.errors[0]


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
    assert config.load({config.DECODE_FALLBACK_ABOVE: "none"}).errors  # not documented
    assert config.load({config.DECODE_FALLBACK_ABOVE: "32768"}).decode_fallback_above == 32768


def test_env_table_documents_every_variable():
    table = config.env_table()
    for var in config.VARIABLES:
        assert f"`{var.name}`" in table


@pytest.mark.parametrize("raw,value", [("", "auto"), ("auto", "auto"), (" Shim ", "shim"),
                                       ("shim", "shim")])
def test_prompt_attention_accepts_auto_and_shim(raw, value):
    s = config.load({config.PROMPT_ATTENTION: raw})
    assert s.prompt_attention == value and s.errors == ()


@pytest.mark.parametrize("raw", ["1", "vendor", "yes", "on", "shims"])
def test_prompt_attention_rejects_anything_else(raw):
    s = config.load({config.PROMPT_ATTENTION: raw})
    assert s.prompt_attention == "auto"
    assert s.errors == (f"{config.PROMPT_ATTENTION}={raw!r} is invalid; accepted: auto, shim "
                        "(using the default auto)",)
