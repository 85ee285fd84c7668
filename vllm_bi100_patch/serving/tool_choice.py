"""``tools`` and ``tool_choice`` of today's clients on vLLM 0.6.3's chat request (part of row
``chat_request_compat``; docs/serving-compat.md, with each mapping's upstream source).

vLLM 0.6.3 knows ``tool_choice`` "none" (refused with tools), "auto" and the named form
``{"type": "function", "function": {"name": ...}}``, and crashes (a 500: ``KeyError:
'function'`` in ``check_tool_usage``) on any other object.  ``tools(data, ...)`` maps a body's
tool fields onto those, in place, and returns the ``ToolPlan`` that row ``chat_tool_calls``
(``serving/tool_calls.py``) serves the answer by:

- the objects: ``{"type": "allowed_tools", "allowed_tools": {"mode": "auto"|"required",
  "tools": [references]}}`` (OpenAI's chat form; the Responses API's, with ``mode`` and
  ``tools`` beside ``type``, too) -> ``tools`` restricted to the allowed ones, in their order,
  and ``tool_choice`` = the mode; the Responses API's ``{"type": "function", "name": X}`` -> the
  named form; every other object or value a 400 naming it;
- "none" -> the tools dropped (vLLM 0.6.4, #10000);
- "required" -> ``guided_json`` = one schema accepting a call of any of the tools, the shape of
  upstream's (vLLM pull request #13483, ``_get_guided_json_from_tool``): an array of at least
  one ``{"name": <that tool's name>, "parameters": <that tool's schema>}``, each tool's
  schema nested with its internal references rewritten to resolve as in its own schema
  (``client_schema.nested``); every tool's schema ``client_schema.check``ed first;
  ``parallel_tool_calls: false`` adds ``maxItems: 1``;
  the validated request then says "none" to 0.6.3 (the answer is plain text to it, no tool
  parser needed) and the plan says ``required`` (row ``chat_tool_calls`` turns the text into
  ``tool_calls``);
- ``strict``: true or false (or null) accepted and dropped from the body (0.6.3's function
  definition has no such field; upstream accepts it from 0.6.5, #10463); the strict tools'
  schemas (``client_schema.check``ed) go into the plan: every call of one of them that the
  server returns is checked against its schema (a violation logged and counted); a forced
  tool (named, required) is enforced by guided decoding as well.  Any other value of
  ``strict`` is a 400 naming it;
- a named tool: its schema ``client_schema.check``ed; without parameters (or ``{}``) it gets
  upstream's empty object, so that 0.6.3 guides its call (a falsy schema guides nothing);
- a forced tool beside ``guided_json`` or a ``json_schema`` response format: a 400 (0.6.3
  silently let the tool's parameters replace the schema).

Plain Python on dicts; never imports vLLM.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from . import client_schema
from .refusal import RequestRefused, shown

MODES = ("auto", "required")
CHOICES = ('"none", "auto", "required", {"type": "function", "function": {"name": ...}}, '
           '{"type": "function", "name": ...} or {"type": "allowed_tools", "allowed_tools": '
           '{"mode": "auto" or "required", "tools": [...]}}')
#: What constrains the answer's text besides a forced tool: refused beside one.
GUIDES = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class ToolPlan:
    """What the chat row decided about a request's tools, attached to the validated request
    (``request_body.request_class``) for row ``chat_tool_calls``.

    ``required``: the tools' names when ``tool_choice`` was "required" (None otherwise);
    ``strict``: name -> parameters schema of each tool sent with ``strict: true``."""

    __slots__ = ("required", "strict")

    def __init__(self, required: Optional[Tuple[str, ...]], strict: Dict[str, Any]) -> None:
        self.required, self.strict = required, strict

    def attach(self, request: Any) -> None:
        request._vllm_bi100_plan = self
        if self.required is not None:
            # 0.6.3 then answers in text (no tool parser, no "auto" check); guided_json holds
            # the calls' schema and row chat_tool_calls turns the text into tool_calls.
            request.tool_choice = "none"

    def __repr__(self) -> str:
        return f"ToolPlan(required={self.required!r}, strict={sorted(self.strict)!r})"


def _name_of(ref: Any, where: str) -> str:
    """The tool name of a reference: ``{"type": "function", "function": {"name": X}}`` or
    ``{"type": "function", "name": X}``."""
    if isinstance(ref, dict) and ref.get("type", "function") == "function":
        fn = ref.get("function")
        name = fn.get("name") if isinstance(fn, dict) else ref.get("name")
        if isinstance(name, str) and name:
            return name
    raise RequestRefused(f"`{where}` {shown(ref)} is not a reference to a function tool "
                         "({\"type\": \"function\", \"function\": {\"name\": ...}})")


def _names(tools: List[Dict[str, Any]]) -> List[str]:
    return [tool["function"]["name"] for tool in tools]


def _check_tools(tools: Any) -> List[Dict[str, Any]]:
    """``tools`` as a list of function tools with names (0.6.3's own checks index them and
    crash otherwise), or a 400 naming the one that is not."""
    if not isinstance(tools, list):
        raise RequestRefused(f"`tools` must be a list of tools, not a {type(tools).__name__}")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestRefused(f"`tools[{i}]` must be a function tool with a name "
                                 "({\"type\": \"function\", \"function\": {\"name\": ...}})")
    return tools


def _choice(data: Dict[str, Any]) -> Any:
    """``tool_choice`` in one of the forms 0.6.3 knows (or "required"), objects mapped."""
    choice = data.get("tool_choice")
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if not isinstance(choice, dict):
        raise RequestRefused(f"`tool_choice` {shown(choice)} is not a tool choice this server "
                             f"serves: send {CHOICES}")
    kind = choice.get("type", "function")
    if kind == "allowed_tools":
        spec = choice.get("allowed_tools", choice)
        mode, refs = (spec.get("mode"), spec.get("tools")) if isinstance(spec, dict) else (
            None, None)
        if mode not in MODES:
            raise RequestRefused(f"`tool_choice.allowed_tools.mode` {shown(mode)}: send \"auto\" "
                                 "or \"required\"")
        if not isinstance(refs, list) or not refs:
            raise RequestRefused("`tool_choice.allowed_tools.tools` must list at least one tool")
        allowed = [_name_of(r, f"tool_choice.allowed_tools.tools[{k}]")
                   for k, r in enumerate(refs)]
        tools = _check_tools(data.get("tools"))
        missing = [n for n in allowed if n not in _names(tools)]
        if missing:
            raise RequestRefused(f"`tool_choice.allowed_tools` names {shown(missing[0])}, which "
                                 "is not in `tools`")
        data["tools"] = [t for t in tools if t["function"]["name"] in allowed]
        data["tool_choice"] = mode
        return mode
    if kind == "function" and "function" in choice:
        fn = choice["function"]
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestRefused("`tool_choice.function` must name a tool: {\"type\": "
                                 "\"function\", \"function\": {\"name\": ...}}")
        return choice
    if kind == "function" and isinstance(choice.get("name"), str) and choice["name"]:
        rest = sorted(set(choice) - {"type", "name"})
        if rest:
            raise RequestRefused(f"`tool_choice.{rest[0]}` is not a field of a named tool "
                                 "choice")
        data["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        return data["tool_choice"]
    raise RequestRefused(f"`tool_choice` {shown(choice)} is not a tool choice this server "
                         f"serves: send {CHOICES}")


def _strict(data: Dict[str, Any]) -> Dict[str, Any]:
    """Drop ``strict`` from every function definition (copying what changes); the schemas of
    the strict tools by name."""
    tools = data.get("tools")
    out: Dict[str, Any] = {}
    if not isinstance(tools, list):
        return out
    new = list(tools)
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if "strict" not in fn:
            continue
        value = fn["strict"]
        if value is not None and not isinstance(value, bool):
            raise RequestRefused(f"`tools[{i}].function.strict` must be true or false, not "
                                 f"{shown(value)}")
        if value:
            params = fn.get("parameters")
            if params is not None:
                client_schema.check(params, f"tools[{i}].function.parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {"type": "object"}
        new[i] = dict(tool, function={k: v for k, v in fn.items() if k != "strict"})
    data["tools"] = new
    return out


#: A tool's parameters when it has none (or ``{}``): upstream's empty object.
NO_PARAMETERS: Dict[str, Any] = {"type": "object", "properties": {}}


def _parameters(params: Any) -> Dict[str, Any]:
    return params if isinstance(params, dict) and params else dict(NO_PARAMETERS)


def required_schema(tools: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One JSON schema accepting a call of any of ``tools``: the shape of upstream's for
    ``tool_choice: "required"`` (vLLM pull request #13483).  Each tool's schema is nested where
    its internal references still resolve to what they did in it
    (``client_schema.nested``)."""
    variants = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        params = client_schema.nested(_parameters(fn.get("parameters")),
                                      f"/items/anyOf/{i}/properties/parameters", f"t{i}")
        variants.append({"properties": {"name": {"type": "string", "enum": [fn["name"]]},
                                        "parameters": params},
                         "required": ["name", "parameters"]})
    return {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}


def _checked(tools: List[Dict[str, Any]], names: Any) -> None:
    """``client_schema.check`` the parameters of the tools named (every tool: None)."""
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if (names is None or fn["name"] in names) and fn.get("parameters") is not None:
            client_schema.check(fn["parameters"], f"tools[{i}].function.parameters")


def _named_parameters(data: Dict[str, Any], name: str) -> None:
    """The named tool without parameters (or ``{}``) gets upstream's empty object, so that
    0.6.3 guides its call (it guides nothing for a falsy schema: free text)."""
    tools = data.get("tools")
    if not isinstance(tools, list):
        return
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if fn["name"] == name and not fn.get("parameters"):
            new = list(tools)
            new[i] = dict(tool, function=dict(fn, parameters=dict(NO_PARAMETERS)))
            data["tools"] = new
            return


def _forced_beside(data: Dict[str, Any], what: str) -> None:
    fmt = data.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object"):
        raise RequestRefused(f"`response_format` {fmt['type']} and {what} both constrain the "
                             "answer: a forced tool call follows the tool's parameters; send "
                             "one of them")
    for guide in GUIDES:
        if data.get(guide) is not None:
            raise RequestRefused(f"`{guide}` and {what} both constrain the answer: a forced "
                                 "tool call follows the tool's parameters; send one of them")


def tools(data: Dict[str, Any], serve_required: bool) -> Optional[ToolPlan]:
    """Map ``data``'s ``tools``/``tool_choice`` in place (see the module docstring); the plan,
    or None when there is nothing for row ``chat_tool_calls`` to do.  ``serve_required``:
    whether row ``chat_tool_calls`` is live (else "required" stays refused)."""
    if data.get("tools") is not None:
        _check_tools(data["tools"])
    choice = _choice(data)
    if choice == "none":  # vLLM 0.6.4 (#10000): no tool is called, the tools are dropped
        data.pop("tool_choice")
        data.pop("tools", None)
        return None
    strict = _strict(data)
    if choice == "required":
        if data.get("tools") == []:  # as upstream: "required" of no tools is "none"
            data.pop("tool_choice")
            data.pop("tools")
            return None
        if data.get("tools") is None:
            raise RequestRefused("`tool_choice: \"required\"` needs `tools`")
        if not serve_required:
            raise RequestRefused("`tool_choice: \"required\"` is not served here: row "
                                 "`chat_tool_calls` of vllm-bi100-patch is off (it turns the "
                                 "guided answer into tool_calls); name the tool in "
                                 "`tool_choice` or use \"auto\"")
        _forced_beside(data, "`tool_choice: \"required\"`")
        _checked(data["tools"], None)
        data["guided_json"] = required_schema(data["tools"])
        if data.get("parallel_tool_calls") is False:
            data["guided_json"]["maxItems"] = 1  # one call only, as OpenAI defines it
        data["tool_choice"] = "auto"  # 0.6.3's validators; the plan then says "none"
        return ToolPlan(tuple(_names(data["tools"])), strict)
    if isinstance(choice, dict):
        _forced_beside(data, "a named `tool_choice`")
        name = choice["function"]["name"]
        if isinstance(data.get("tools"), list):
            _checked(data["tools"], (name,))
        _named_parameters(data, name)
    return ToolPlan(None, strict) if strict else None


__all__: List[str] = ["ToolPlan", "required_schema", "tools"]
