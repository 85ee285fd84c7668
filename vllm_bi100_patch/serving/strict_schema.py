"""The validator of the strict check (``tool_args.check_call``): a client's schema applied to the
arguments a model wrote, as data only (docs/serving-compat.md, "What the shim does with a
client schema").

jsonschema's defaults are not safe for a client's schema: its default registry retrieves a
remote ``$ref`` through ``urlopen`` with no time-out (and reads ``file:`` references), and its
``pattern``, ``patternProperties`` and ``additionalProperties`` run the client's pattern with
Python's ``re``, which backtracks without bound while holding the GIL (``^(a|a)*$`` against 30
``a`` and ``!``: minutes), so no thread can keep the server's event loop running beside it.
``violation`` builds the validator jsonschema chose for the schema (``validator_for``) with:

- a ``referencing.Registry`` whose retrieval always fails: references resolve within the schema
  only (the request's validation refused any other already: ``client_schema.check``);
- ``pattern``, ``patternProperties`` and ``additionalProperties`` that run patterns with the
  ``regex`` module (a dependency of vLLM through transformers) under the check's time budget,
  ``concurrent=True`` (it releases the GIL while it matches);
- every keyword under the same deadline: a check that exceeds ``BUDGET_S`` stops
  (``OverBudget``);
- a format checker of the formats OpenAI's strict mode lists (``json_formats``); other formats
  are annotations (``formats_unchecked`` names them).

A schema the validator cannot apply that way (``unevaluatedProperties`` beside
``patternProperties``, whose evaluation runs ``re`` inside jsonschema; no ``regex`` module for a
schema with patterns; a jsonschema without ``referencing``) raises ``Unchecked`` with the
reason.  Never imports vLLM; jsonschema, referencing and regex are imported when first used.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

from . import json_formats

#: The most seconds one request's strict check may take (its calls together).
BUDGET_S = 0.5
_state = threading.local()
_classes: Dict[type, type] = {}
_classes_lock = threading.Lock()


class OverBudget(Exception):
    """The check ran past its deadline."""


class Unchecked(Exception):
    """The schema cannot be applied safely here (the message says why)."""


def deadline(budget: float = BUDGET_S) -> float:
    return time.monotonic() + budget


def _left() -> float:
    left = getattr(_state, "deadline", 0.0) - time.monotonic()
    if left <= 0:
        raise OverBudget()
    return left


def _search(pattern: str, text: str) -> bool:
    """Whether ``pattern`` matches somewhere in ``text`` (ECMA-262's ``pattern`` semantics as
    jsonschema applies them), under the deadline."""
    try:
        import regex
    except ImportError:
        raise Unchecked("the regex module is not installed (patterns are never run with "
                        "Python's re)") from None
    try:
        compiled = _compiled(regex, pattern)
    except regex.error:
        raise Unchecked("a pattern the regex engine cannot compile") from None
    try:
        return compiled.search(text, timeout=_left(), concurrent=True) is not None
    except TimeoutError:
        raise OverBudget() from None


_cache: Dict[str, Any] = {}


def _compiled(regex: Any, pattern: str) -> Any:
    found = _cache.get(pattern)
    if found is None:
        found = regex.compile(pattern)
        if len(_cache) >= 256:
            _cache.clear()
        _cache[pattern] = found
    return found


def _pattern(validator: Any, patrn: Any, instance: Any, schema: Any) -> Iterator[Any]:
    from jsonschema.exceptions import ValidationError

    if validator.is_type(instance, "string") and not _search(patrn, instance):
        yield ValidationError(f"{instance!r} does not match {patrn!r}")


def _pattern_properties(validator: Any, pattern_properties: Any, instance: Any,
                        schema: Any) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in pattern_properties.items():
        for k, v in instance.items():
            if _search(pattern, k):
                yield from validator.descend(v, subschema, path=k, schema_path=pattern)


def _additional_properties(validator: Any, ap: Any, instance: Any, schema: Any
                           ) -> Iterator[Any]:
    from jsonschema.exceptions import ValidationError

    if not validator.is_type(instance, "object"):
        return
    properties = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    extras = [p for p in instance if p not in properties
              and not any(_search(pat, p) for pat in patterns)]
    if validator.is_type(ap, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], ap, path=extra)
    elif not ap and extras:
        shown = ", ".join(repr(e) for e in sorted(extras, key=str))
        yield ValidationError(f"Additional properties are not allowed ({shown} unexpected)")


def _timed(func: Callable[..., Any]) -> Callable[..., Any]:
    def keyword(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[Any]:
        _left()
        return func(validator, value, instance, schema) or iter(())

    return keyword


OWN = {"pattern": _pattern, "patternProperties": _pattern_properties,
       "additionalProperties": _additional_properties}


def _safe_class(cls: type) -> type:
    """``cls`` (a jsonschema validator class) with the keywords above and every keyword timed."""
    with _classes_lock:
        found = _classes.get(cls)
        if found is None:
            import jsonschema

            keywords = dict(cls.VALIDATORS)  # type: ignore[attr-defined]
            keywords.update((k, f) for k, f in OWN.items() if k in keywords)
            found = jsonschema.validators.extend(
                cls, {k: _timed(f) for k, f in keywords.items()})
            _classes[cls] = found
        return found


def _format_checker() -> Any:
    import jsonschema

    checker = jsonschema.FormatChecker(formats=())
    for name in json_formats.FORMATS:
        checker.checks(name)(lambda value, fmt=name: bool(json_formats.check(fmt, value)))
    return checker


def _no_retrieval(uri: str) -> Any:
    from referencing.exceptions import NoSuchResource

    raise NoSuchResource(ref=uri)


def scan(schema: Any) -> Tuple[Set[str], bool, bool]:
    """The formats ``schema`` names that are not checked, whether it has patterns, and whether
    it has ``unevaluatedProperties`` beside ``patternProperties`` (a bounded walk: the schema
    passed ``client_schema.check``)."""
    unknown: Set[str] = set()
    patterns = unevaluated = False
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            fmt = node.get("format")
            if isinstance(fmt, str) and fmt not in json_formats.CHECKS:
                unknown.add(fmt)
            patterns |= "pattern" in node or "patternProperties" in node
            unevaluated |= "unevaluatedProperties" in node
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
    return unknown, patterns, unevaluated and patterns


def violation(value: Any, schema: Any, until: float) -> Optional[Any]:
    """The best-matching error of ``value`` under ``schema`` (a jsonschema ``ValidationError``)
    or None; raises ``OverBudget`` past ``until`` (``time.monotonic()``), ``Unchecked`` for a
    schema that cannot be applied safely, and whatever jsonschema raises for a schema it cannot
    use (``RecursionError`` included)."""
    import jsonschema

    try:
        from referencing import Registry
    except ImportError:
        raise Unchecked("jsonschema older than 4.18 (no referencing registry): references "
                        "could not be kept within the schema") from None
    _, patterns, unevaluated = scan(schema)
    if unevaluated:
        raise Unchecked("unevaluatedProperties beside patternProperties (jsonschema would "
                        "run the pattern with Python's re)")
    if patterns:
        try:
            import regex  # noqa: F401
        except ImportError:
            raise Unchecked("the regex module is not installed (patterns are never run with "
                            "Python's re)") from None
    cls = _safe_class(jsonschema.validators.validator_for(schema))
    validator = cls(schema, registry=Registry(retrieve=_no_retrieval),  # type: ignore[call-arg]
                    format_checker=_format_checker())
    _state.deadline = until
    try:
        return jsonschema.exceptions.best_match(validator.iter_errors(value))
    finally:
        _state.deadline = 0.0


__all__: List[str] = ["BUDGET_S", "OverBudget", "Unchecked", "deadline", "scan", "violation"]
