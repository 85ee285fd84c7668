"""An instance of a JSON schema: what a model held to that schema by guided decoding answers.

Standard library only: the engine stand-in (``standin_server.py``) imports it in the vLLM
venv; ``test_schema_instance.py`` checks it there.  Deterministic: the same schema gives the
same instance, and every string says where in the instance it stands (``"city"`` for a
property ``city``, ``"tags.1"`` for an array's second item), so a client's parsed result can be
compared with what the engine produced.

Covers what pydantic and the frameworks emit: ``type`` (one or a list), ``properties``,
``required``, ``additionalProperties``, ``items``, ``prefixItems``, ``minItems`` /
``maxItems``, ``uniqueItems``, ``enum`` / ``const``, ``minimum`` / ``maximum`` (exclusive
too), ``minLength`` / ``maxLength``, the common string ``format``s, ``$ref`` into ``$defs`` or
``definitions`` (pydantic's nested models), ``anyOf`` / ``oneOf`` (the first branch that is
not ``null``), ``allOf`` (merged).  Below ``DEPTH`` levels only what is required is filled, so
a recursive model's instance ends.  What it cannot satisfy (``pattern``, ``not``, a ``$ref``
outside the document) raises ``Unsupported``: never an instance that does not fit.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Dict, List, Optional
from urllib.parse import unquote

FORMATS = {"date": "2024-05-06", "date-time": "2024-05-06T07:08:09Z", "time": "07:08:09",
           "email": "user@example.com", "uri": "https://example.com/a", "url":
           "https://example.com/a", "uuid": "12345678-1234-5678-1234-567812345678",
           "ipv4": "192.0.2.1", "hostname": "example.com", "duration": "P1D"}


class Unsupported(ValueError):
    """The schema asks for something this generator cannot produce exactly."""


#: Below this depth an instance takes only what its schema requires: no optional property, the
#: fewest array items, the null branch of an anyOf (a recursive model's tree ends).
DEPTH = 6


def instance(schema: Any, root: Optional[dict] = None, path: str = "", depth: int = 0) -> Any:
    """One instance of ``schema`` (a dict, or ``True`` for anything); ``root`` is the document
    its ``$ref``s point into (default: ``schema``); ``path`` where it stands in the whole."""
    if schema is True or schema == {}:
        return path or "value"
    if not isinstance(schema, dict):
        raise Unsupported(f"{path or 'value'}: schema {schema!r} is not an object")
    root = schema if root is None else root
    for key in ("pattern", "not", "if", "patternProperties"):
        if key in schema:
            raise Unsupported(f"{path or 'value'}: '{key}' is not supported")
    if "$ref" in schema:
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        return instance(_merge(_resolve(root, schema["$ref"], path), rest), root, path, depth)
    if "allOf" in schema:
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            if "$ref" in part:
                part = _resolve(root, part["$ref"], path)
            merged = _merge(merged, part)
        return instance(merged, root, path, depth)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            branches = schema[key]
            chosen = next((b for b in branches if not _is_null(b)), branches[0])
            if depth >= DEPTH:
                chosen = next((b for b in branches if _is_null(b)), chosen)
            rest = {k: v for k, v in schema.items() if k != key}
            return instance(_merge(rest, chosen), root, path, depth)
    if "const" in schema:
        return copy.deepcopy(schema["const"])
    if "enum" in schema:
        return copy.deepcopy(schema["enum"][0])
    kind = _type(schema)
    if kind == "object":
        return _object(schema, root, path, depth + 1)
    if kind == "array":
        return _array(schema, root, path, depth + 1)
    if kind == "string":
        return _string(schema, path or "value")
    if kind in ("integer", "number"):
        return _number(schema, kind == "integer", path)
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    raise Unsupported(f"{path or 'value'}: type {kind!r} is not supported")


def _is_null(branch: Any) -> bool:
    return isinstance(branch, dict) and branch.get("type") == "null"


def _resolve(root: dict, ref: str, path: str) -> dict:
    if not ref.startswith("#/"):
        raise Unsupported(f"{path or 'value'}: $ref {ref!r} points outside the schema")
    node: Any = root
    for part in ref[2:].split("/"):  # RFC 6901 tokens in a URI fragment (RFC 3986 escapes)
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise Unsupported(f"{path or 'value'}: $ref {ref!r} does not resolve")
    return node


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if key == "properties" and "properties" in out:
            out[key] = {**out[key], **value}
        elif key == "required" and "required" in out:
            out[key] = list(dict.fromkeys([*out[key], *value]))
        else:
            out[key] = value
    return out


def _type(schema: dict) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        if "properties" in schema or "additionalProperties" in schema:
            return "object"
        if "items" in schema or "prefixItems" in schema:
            return "array"
        return "string"
    return kind


def _at(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


def _object(schema: dict, root: dict, path: str, depth: int) -> Dict[str, Any]:
    props = schema.get("properties", {})
    required = schema.get("required", [])
    out = {name: instance(sub, root, _at(path, name), depth) for name, sub in props.items()
           if depth < DEPTH or name in required}
    extra = schema.get("additionalProperties", True)
    for name in required:
        if name not in out:
            if extra is False:
                raise Unsupported(f"{_at(path, name)}: required but not allowed")
            out[name] = instance({} if extra is True else extra, root, _at(path, name), depth)
    least = schema.get("minProperties", 0)
    while len(out) < least:
        if extra is False:
            raise Unsupported(f"{path or 'value'}: minProperties {least} with no more "
                              f"properties allowed")
        key = f"key{len(out)}"
        out[key] = instance({} if extra is True else extra, root, _at(path, key), depth)
    return out


def _array(schema: dict, root: dict, path: str, depth: int) -> List[Any]:
    prefix = schema.get("prefixItems", [])
    out = [instance(sub, root, _at(path, i), depth) for i, sub in enumerate(prefix)]
    items = schema.get("items", {} if not prefix else False)
    count = max(schema.get("minItems", 0), len(out) if prefix or depth >= DEPTH else 1)
    if "maxItems" in schema:
        count = min(count, schema["maxItems"])
    while len(out) < count:
        if items is False:
            break
        out.append(instance(items, root, _at(path, len(out)), depth))
    if len(out) < schema.get("minItems", 0):
        raise Unsupported(f"{path or 'value'}: minItems {schema['minItems']} beyond its "
                          f"prefixItems")
    if schema.get("uniqueItems") and len({repr(x) for x in out}) != len(out):
        raise Unsupported(f"{path or 'value'}: uniqueItems with items this generator repeats")
    return out


def _string(schema: dict, path: str) -> str:
    text = FORMATS.get(schema.get("format", ""), path)
    least, most = schema.get("minLength", 0), schema.get("maxLength")
    if len(text) < least:
        text = text + "x" * (least - len(text))
    if most is not None and len(text) > most:
        if "format" in schema:
            raise Unsupported(f"{path or 'value'}: maxLength {most} below its format's text")
        text = text[:most]
    return text


def _number(schema: dict, integer: bool, path: str):
    step = 1 if integer else 0.5
    low = schema.get("minimum")
    if "exclusiveMinimum" in schema:
        low = schema["exclusiveMinimum"] + step
    high = schema.get("maximum")
    if "exclusiveMaximum" in schema:
        high = schema["exclusiveMaximum"] - step
    if low is not None:
        value = low
    elif high is not None:
        value = min(high, 3)
    else:
        value = 3 if integer else 3.25
    if integer and value != int(value):
        value = math.ceil(value)
    if high is not None and value > high or low is not None and value < low:
        raise Unsupported(f"{path or 'value'}: no {'integer' if integer else 'number'} in [{low}, {high}]")
    if "multipleOf" in schema:
        raise Unsupported(f"{path or 'value'}: multipleOf is not supported")
    return int(value) if integer else float(value)
