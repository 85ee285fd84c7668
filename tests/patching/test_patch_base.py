"""What every patch module shares (``patches/factories.py``): the factory type, the argument
reader, and call counters that a row declares in the table, so that a new row's first call can
never fail on a counter its module forgot to register; every counter of the process is one
call (``counters.snapshot()``)."""

from __future__ import annotations

import importlib
import inspect
import threading
import types

import pytest

from vllm_bi100_patch.activation import config
from vllm_bi100_patch.patching.counting import counters
from vllm_bi100_patch.patching import registry, specs, table
from vllm_bi100_patch.patching import factories
from vllm_bi100_patch.patching import patch_row

ON = config.load({config.MODE: "1"})


def _modules():
    return {row.factory.partition(":")[0] for row in table.methods()}


def test_every_declared_counter_is_registered_by_its_rows_module():
    for name in _modules():
        importlib.import_module(name)
    counts = counters.snapshot()
    declared = [n for row in table.PATCHES for n in row.counters]
    assert len(declared) == len(set(declared))
    assert set(declared) <= set(counts), set(declared) - set(counts)
    routes = [k for k in counts if k.startswith("decode_")]
    assert routes == ["decode_native_v1", "decode_native_v2", "decode_fallback"]
    assert list(counts)[-3:] == routes  # the calls first, then the routes
    assert factories.call_counts() == counts


def test_a_counter_no_row_declares_is_refused_where_it_is_asked_for():
    with pytest.raises(ValueError, match=r"no row of vllm_bi100_patch.patching.table declares the "
                                         r"counter 'forgotten'.*counters=\(\.\.\.\)"):
        factories.counter("forgotten")
    assert "forgotten" not in counters.snapshot()


def test_every_factory_has_the_factory_type():
    expected = [p for p in inspect.signature(factories.Factory.__call__).parameters if p != "self"]
    for row in table.methods():
        factory = specs.PatchSpec(row).factory()
        assert list(inspect.signature(factory).parameters) == expected, row


def test_counts_are_exact_under_threads():
    count = counters.register("forward_decode")
    before = count.value

    def add():
        for _ in range(5000):
            count.add()

    threads = [threading.Thread(target=add) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert count.value == before + 20000
    factories.reset_call_counts()
    assert set(counters.snapshot().values()) == {0}


def test_reader_counts_each_call_it_read_and_raises_as_python_would():
    count = counters.register("forward_prefix")
    before = count.value

    def target(a, b, c=3):
        pass

    reader = factories.ArgReader.for_function(target, ("a", "b", "c"), "target", count)
    assert reader.read((1,), {"b": 2}) == [1, 2, 3]
    with pytest.raises(TypeError, match="missing required argument: 'b'"):
        reader.read((1,), {})
    with pytest.raises(TypeError, match="multiple values"):
        reader.read((1, 2), {"a": 1})
    assert count.value == before + 1  # only the call it read


def test_a_new_row_with_a_counter_is_its_row_its_module_and_nothing_else(paged_attn_module,
                                                                           monkeypatch):
    """A row declares its counter; its module takes the handle at import and counts: no
    ``setdefault`` to remember, and ``status()["counts"]`` shows it."""
    module = types.ModuleType("bi100_test_row")
    source = (
        "from vllm_bi100_patch.patching.factories import ArgReader, counter\n"
        "CALLS = counter('head_size_calls')\n"
        "def factory(family, original, module, settings):\n"
        "    reader = ArgReader.for_function(original, (), 'get_supported_head_sizes', CALLS)\n"
        "    def wrapper(wrapped, instance, args, kwargs):\n"
        "        reader.read(args, kwargs)\n"
        "        return [128]\n"
        "    return wrapper\n")
    row = patch_row.Patch("head_sizes", patch_row.WRAP_METHOD,
                      patch_row.PAGED_ATTN + ":PagedAttention.get_supported_head_sizes",
                      "bi100_test_row:factory", params="names:", why="w", how="h",
                      vllm="v", upstream="u", removal="r", counters=("head_size_calls",))
    monkeypatch.setattr(table, "PATCHES", table.PATCHES + (row,))
    monkeypatch.setattr(factories, "DECLARED", factories.DECLARED | {"head_size_calls"})
    monkeypatch.setattr(specs, "SPECS", tuple(specs.PatchSpec(r) for r in table.methods()))
    monkeypatch.setitem(counters._groups, "calls", dict(counters._groups["calls"]))
    exec(compile(source, "bi100_test_row", "exec"), module.__dict__)
    monkeypatch.setitem(importlib.sys.modules, "bi100_test_row", module)
    mod = paged_attn_module("0.8.5")
    try:
        assert "head_sizes" in registry.apply_to(mod, ON).applied
        assert mod.PagedAttention.get_supported_head_sizes() == [128]
        assert factories.call_counts()["head_size_calls"] == 1
    finally:
        registry.revert_all()


def test_the_code_checks_parse_one_thread_at_a_time(monkeypatch):
    """CPython 3.11 (< 3.11.8) shares the AST converter's recursion depth between threads
    (python/cpython#106905): decode's native profile, built per ops object, parsed in four
    threads at once and failed with ``SystemError: AST constructor recursion depth mismatch``
    in CI.  Every parse of the shim's is serialized by ``source.parse``."""
    import ast
    import time

    from vllm_bi100_patch.serving import guided_imports
    from vllm_bi100_patch.patching import source

    inside, most, real = [0], [0], ast.parse
    guard = threading.Lock()

    def slow_parse(text, *args, **kwargs):
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.002)
        with guard:
            inside[0] -= 1
        return real(text, *args, **kwargs)

    monkeypatch.setattr(ast, "parse", slow_parse)

    def work():
        for _ in range(10):
            assert source.function_def(test_the_code_checks_parse_one_thread_at_a_time)
            assert len(guided_imports.reader_shape(guided_imports.__file__)) == 16

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1
