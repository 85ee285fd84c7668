"""The serving rows of issue 35 without vLLM: a replaced class rebound wherever a module bound
it and put back by revert (``rebind``), the message-less exceptions explained by their own
kind (``error_cause``), a guide that cannot be built named with its cause (``guided``).
Through vLLM 0.6.3's own engines, app and guided decoding: tests/serving/test_serving_engine.py.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import types
import typing

from vllm_bi100_patch.activation import config
from vllm_bi100_patch.patching import rebind, registry, specs, table
from vllm_bi100_patch.serving import error_cause, guided
from vllm_bi100_patch.patching import patch_row

ON = config.load({config.MODE: "1"})


def test_a_replaced_class_is_rebound_wherever_bound_and_reverted(paged_attn_module,
                                                                 monkeypatch):
    paged_attn_module("0.6.3.post1")  # an installed vLLM version for the decision
    home = types.ModuleType("vllm.bi100_test_protocol")

    class Request:
        pass

    home.Request = Request
    binder = types.ModuleType("vllm.bi100_test_server")
    binder.Request = Request
    binder.Alias = Request
    binder.Optional = typing.Optional
    # an endpoint as FastAPI reads it: annotations evaluated when defined (no PEP 563)
    exec(compile("def endpoint(request: Request, other: Optional[Request] = None):\n"
                 "    return None\n", "<endpoint>", "exec", dont_inherit=True), binder.__dict__)
    endpoint = binder.endpoint
    factories = types.ModuleType("bi100_test_rebind_factories")
    factories.factory = lambda family, original, mod, settings: type("Request", (original,), {})
    factories.check = lambda cls: None
    for mod in (home, binder, factories):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    row = patch_row.Patch("request_compat", patch_row.REPLACE_CLASS, home.__name__ + ":Request",
                      "bi100_test_rebind_factories:factory",
                      params="code:bi100_test_rebind_factories:check", why="w", how="h",
                      vllm="v", upstream="u", removal="r")
    monkeypatch.setattr(table, "PATCHES", table.PATCHES + (row,))
    monkeypatch.setattr(specs, "SPECS", tuple(specs.PatchSpec(r) for r in table.methods()))
    assert registry.apply_to(home, ON).applied == ["request_compat"]
    new = home.Request
    assert new is not Request and binder.Request is new and binder.Alias is new
    assert endpoint.__annotations__["request"] is new
    assert typing.get_args(endpoint.__annotations__["other"]) == (new, type(None))
    bound = rebind.state()["Request"]
    assert sorted(bound["globals"]) == ["vllm.bi100_test_server.Alias",
                                        "vllm.bi100_test_server.Request"]
    assert sorted(bound["annotations"]) == ["vllm.bi100_test_server.endpoint(other)",
                                            "vllm.bi100_test_server.endpoint(request)"]
    assert bound["models"] == [] and bound["stale_routes"] == 0
    registry.revert_all()
    assert home.Request is Request and binder.Request is Request and binder.Alias is Request
    assert endpoint.__annotations__["request"] is Request
    assert typing.get_args(endpoint.__annotations__["other"]) == (Request, type(None))
    assert rebind.state() == {}


def _explained(exc: BaseException) -> str:
    try:
        raise exc
    except BaseException:  # noqa: B902 - what create_error_response is called under
        return error_cause._cause()


def test_a_message_less_exception_is_explained_by_its_own_kind():
    template_error = type("TemplateError", (Exception,), {"__module__": "jinja2.exceptions"})
    assert _explained(template_error()).startswith(
        "TemplateError (raised without a message; the chat template failed on this request")
    assert "image" not in _explained(template_error())
    timeout = _explained(asyncio.TimeoutError())
    assert timeout.startswith("TimeoutError (raised without a message; a time-out, e.g. "
                              "fetching an image or audio URL")
    try:
        try:
            raise KeyError("model")
        except KeyError as inner:
            raise RuntimeError() from inner
    except RuntimeError:
        chained = error_cause._cause()
    assert chained.startswith("RuntimeError (raised without a message; caused by KeyError: "
                              "'model'")
    assert _explained(RuntimeError()) == ("RuntimeError (raised without a message; the server "
                                          "log has the traceback)")
    assert _explained(ValueError("bad")) == "ValueError: bad"


def test_a_guide_that_cannot_be_built_is_named_with_its_cause():
    params = types.SimpleNamespace(json=None, regex=None, choice=["a", "b"])
    missing = ModuleNotFoundError("No module named 'pyairports'", name="pyairports")
    text = str(guided.unavailable(params, "outlines", missing))
    assert text.startswith("guided decoding (choice, backend outlines) cannot be built on this "
                           "server: ModuleNotFoundError: No module named 'pyairports'; outlines "
                           "0.0.x imports pyairports.airports")
    assert "guided_decoding_imports" in text and "lm-format-enforcer" in text
    assert isinstance(guided.unavailable(params, None, KeyError()), ValueError)
    other = str(guided.unavailable(types.SimpleNamespace(json={"type": "object"}), None,
                                   NotImplementedError()))
    assert other == ("guided decoding (json, backend default) cannot be built on this server: "
                     "NotImplementedError")


def test_only_an_exception_raised_inside_a_backend_is_the_guides():
    module = types.ModuleType("outlines.bi100_fake")
    exec("def build():\n    raise KeyError('x')\n", module.__dict__)
    try:
        module.build()
    except KeyError as exc:
        assert guided.from_builder(exc)
    try:
        raise KeyError("elsewhere")
    except KeyError as exc:
        assert not guided.from_builder(exc)
    assert importlib.util is not None
