"""A JSON schema a client sends, taken as data (docs/serving-compat.md, "What the shim does with a
client schema").

Every schema that something on the server reads (a strict tool's parameters, a forced tool's,
the tools of ``tool_choice: "required"``, ``response_format`` ``json_schema``, ``guided_json``,
on the chat and the completions endpoints) goes through ``check`` when the request is
validated, before anything else sees it:

- it is resolved only within itself: every reference (``$ref``, ``$dynamicRef``,
  ``$recursiveRef``) must be a fragment of the schema itself (``#``, ``#/a/b``, ``#name``); a
  reference to anything else (``http:``, ``file:``, a relative path, a URN) is a 400 naming it
  and where it stands.  The server never retrieves a document a request names (jsonschema's
  default registry would ``urlopen`` a remote reference with no time-out);
- it stays within limits: at most ``MAX_NODES`` JSON values (``MAX_REQUEST_NODES`` for all the
  schemas of a request together, inside ``request()``), nested at most ``MAX_DEPTH`` deep,
  a ``pattern`` (or ``patternProperties`` key) of at most ``MAX_PATTERN`` characters; beyond
  them a 400 naming the limit.  The walk is iterative and linear in the schema's size (the JSON
  parser already read every byte of it).

``nested`` copies a tool's schema into the calls' schema of ``tool_choice: "required"`` with its
internal references rewritten so that each resolves to what it resolved to in the tool's own
schema (pointers, ``$defs`` at any depth, ``"#"``, anchors, embedded ``$id`` resources).

``EMPTY_OBJECT``: what an empty schema (``{}``) is guided as (a JSON object, as OpenAI defines a
response format and a tool without parameters): vLLM 0.6.3's outlines path tests ``if
guided_params.json:``, false for ``{}``, and would leave the answer free text.

Plain Python on dicts; never imports vLLM.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Dict, Iterator, List, Tuple
from urllib.parse import quote

from .refusal import RequestRefused, shown

#: The most JSON values (objects, arrays, scalars) one schema may hold.
MAX_NODES = 20_000
#: The most JSON values all the schemas of one request may hold together (``request``).
MAX_REQUEST_NODES = 50_000
#: The deepest nesting of one schema (JSON levels; a tool of 10 nested objects is about 30).
MAX_DEPTH = 64
#: The longest ``pattern`` (and ``patternProperties`` key), in characters.
MAX_PATTERN = 2_000
#: The reference keywords (resolved only within the schema).
REFS = ("$ref", "$dynamicRef", "$recursiveRef")
#: Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
ONE = ("additionalProperties", "additionalItems", "contains", "not", "if", "then", "else",
       "propertyNames", "unevaluatedItems", "unevaluatedProperties", "items")
MANY = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
        "dependencies")
#: What an empty schema is guided as.
EMPTY_OBJECT: Dict[str, Any] = {"type": "object"}


_spent: contextvars.ContextVar = contextvars.ContextVar("vllm_bi100_schema_values")


@contextlib.contextmanager
def request() -> Iterator[None]:
    """The scope of one request's mapping: the schemas ``check``ed inside it hold at most
    ``MAX_REQUEST_NODES`` values together (a request of many tools cannot multiply the walk)."""
    token = _spent.set([0])
    try:
        yield
    finally:
        _spent.reset(token)


def _where(path: Tuple[Any, ...]) -> str:
    return "/" + "/".join(str(p) for p in path) if path else "the top"


def check(schema: Any, where: str) -> None:
    """Refuse (``RequestRefused``, a 400 naming ``where``) a schema that refers outside
    itself or exceeds the limits; return None for one that is served."""
    nodes = 0
    spent = _spent.get(None)
    # (value, JSON depth, path, whether the value is a schema)
    stack: List[Tuple[Any, int, Tuple[Any, ...], bool]] = [(schema, 1, (), True)]
    while stack:
        value, depth, path, is_schema = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise RequestRefused(f"`{where}` holds more than {MAX_NODES} JSON values: this "
                                 "server reads client schemas up to that size")
        if spent is not None:
            spent[0] += 1
            if spent[0] > MAX_REQUEST_NODES:
                raise RequestRefused(f"the request's schemas hold more than {MAX_REQUEST_NODES} "
                                     f"JSON values together (at `{where}`): this server reads "
                                     "client schemas up to that size per request")
        if depth > MAX_DEPTH:
            raise RequestRefused(f"`{where}` nests deeper than {MAX_DEPTH} levels (at "
                                 f"{shown(_where(path[:8]))}...): this server reads client "
                                 "schemas up to that depth")
        if isinstance(value, list):
            stack.extend((v, depth + 1, path + (k,), is_schema) for k, v in enumerate(value))
            continue
        if not isinstance(value, dict):
            continue
        for key, sub in value.items():
            here = path + (key,)
            if not is_schema:
                stack.append((sub, depth + 1, here, False))
                continue
            if key in REFS:
                _reference(sub, key, where, path)
            elif key == "pattern" and isinstance(sub, str):
                _pattern(sub, where, here)
            if key in MAPS and isinstance(sub, dict):
                if key == "patternProperties":
                    for name in sub:
                        _pattern(str(name), where, here)
                stack.extend((v, depth + 2, here + (k,), True) for k, v in sub.items())
            else:
                stack.append((sub, depth + 1, here, key in ONE or key in MANY))


def _reference(ref: Any, key: str, where: str, path: Tuple[Any, ...]) -> None:
    if not isinstance(ref, str):
        raise RequestRefused(f"`{where}` has a {key} that is not a string (at "
                             f"{shown(_where(path))}): {shown(ref)}")
    if not ref.startswith("#"):
        raise RequestRefused(
            f"`{where}` refers to {shown(ref)} ({key} at {shown(_where(path))}), outside the "
            "schema: this server resolves a client's schema only within itself (references "
            "that start with '#') and never retrieves a document a request names")


def _pattern(pattern: str, where: str, path: Tuple[Any, ...]) -> None:
    if len(pattern) > MAX_PATTERN:
        raise RequestRefused(f"`{where}` has a pattern of {len(pattern)} characters (at "
                             f"{shown(_where(path))}): this server takes patterns of at most "
                             f"{MAX_PATTERN}")


def guided(schema: Any) -> Any:
    """The schema a guide is built from: ``EMPTY_OBJECT`` for ``{}`` (a copy), else
    ``schema``."""
    return dict(EMPTY_OBJECT) if isinstance(schema, dict) and not schema else schema


# --- a tool's schema nested into the calls' schema of tool_choice "required" -------------


def token(name: Any) -> str:
    """``name`` as a JSON-pointer token in a URI fragment (RFC 6901, RFC 3986)."""
    return quote(str(name).replace("~", "~0").replace("/", "~1"), safe="~!$&'()*+,;=:@")


class _Nesting:
    """The state of one ``nested`` copy: the pointer of each resource, the anchors renamed."""

    def __init__(self, prefix: str, tag: str) -> None:
        self.prefix, self.tag = prefix, tag
        self.resources = 0

    def anchor(self, resource: int, name: str) -> str:
        return f"{self.tag}r{resource}_{name}"

    def copy(self, value: Any, pointer: str, base: str, resource: int, is_schema: bool) -> Any:
        if isinstance(value, list):
            return [self.copy(v, f"{pointer}/{k}", base, resource, is_schema)
                    for k, v in enumerate(value)]
        if not isinstance(value, dict) or not is_schema:
            return value if not isinstance(value, dict) else {
                k: self.copy(v, f"{pointer}/{token(k)}", base, resource, False)
                for k, v in value.items()}
        if isinstance(value.get("$id"), str) and pointer != self.prefix:
            self.resources += 1  # an embedded resource: its references are relative to it
            base, resource = pointer, self.resources
        out: Dict[str, Any] = {}
        for key, sub in value.items():
            here = f"{pointer}/{token(key)}"
            if key in ("$id", "$schema"):
                continue  # one resource now: every reference is a pointer from its root
            if key in REFS and isinstance(sub, str) and sub.startswith("#"):
                fragment = sub[1:]
                out[key] = "#" + (base + fragment if fragment == "" or fragment.startswith("/")
                                  else self.anchor(resource, fragment))
            elif key in ("$anchor", "$dynamicAnchor") and isinstance(sub, str):
                out[key] = self.anchor(resource, sub)
            elif key in MAPS and isinstance(sub, dict):
                out[key] = {k: self.copy(v, f"{here}/{token(k)}", base, resource, True)
                            for k, v in sub.items()}
            else:
                out[key] = self.copy(sub, here, base, resource, key in ONE or key in MANY)
        return out


def nested(schema: Dict[str, Any], prefix: str, tag: str) -> Dict[str, Any]:
    """A copy of ``schema`` (``check``ed) for the place ``prefix`` (a JSON pointer, e.g.
    ``/items/anyOf/0/properties/parameters``) of a larger schema: every internal reference
    rewritten to point where it pointed in ``schema`` (``"#"`` and ``"#/..."`` prefixed,
    anchors renamed with ``tag``, embedded ``$id`` resources made pointers), ``$id`` and
    ``$schema`` dropped (the larger schema is one resource)."""
    return _Nesting(prefix, tag).copy(schema, prefix, prefix, 0, True)


__all__: List[str] = ["EMPTY_OBJECT", "MAX_DEPTH", "MAX_NODES", "MAX_PATTERN",
                      "MAX_REQUEST_NODES", "check", "guided", "nested", "request", "token"]
