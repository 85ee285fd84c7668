"""What the engine stand-in of serving_app.py answers: text that fits the request, as a model
under vLLM's own machinery would give it.

- guided JSON reached the engine (``SamplingParams.guided_decoding.json``: a ``json_schema``
  response format, a named tool's parameters, the calls' schema of ``tool_choice:
  "required"``): an instance of that schema (``instance``), in pieces of a few characters;
- tools reached the chat template (it lists their names after ``<|tools|>``) and nothing is
  guided: a hermes ``<tool_call>`` of the first tool listed, with the arguments ``ARGS`` holds
  for it, in the pieces vLLM 0.6.3's hermes parser streams without its known defects (the
  ``<tool_call>`` token never alone in a delta), then the end-of-sequence step (``EOS``: no
  text, the EOS token), as a model that stops after ``</tool_call>`` gives it;
- anything else: ``ANSWER``.

Stdlib only (no vLLM).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

ANSWER = ["hello", " world", " again"]
#: The arguments the stand-in calls each tool with (a tool not here: ``{"text": "x"}``).
ARGS: Dict[str, Dict[str, Any]] = {
    "get_weather": {"city": "Paris"},
    "bad_weather": {"city": 7},  # violates its schema ({"city": string}): a strict check fails
    "final_result": {"answer": "forty-two"},
}
PIECE = 8
#: The end-of-sequence step: no text (vLLM leaves the EOS token out of the text).
EOS = None


def _resolve(ref: str, root: Dict[str, Any]) -> Any:
    node: Any = root
    for part in ref.lstrip("#/").split("/"):
        node = node[part]
    return node


def instance(schema: Any, root: Optional[Dict[str, Any]] = None) -> Any:
    """A value that the JSON schema accepts (the first choice of every choice; every property;
    ``minItems`` items, at least one)."""
    root = root if root is not None else schema
    if not isinstance(schema, dict):
        return None
    if "$ref" in schema:
        return instance(_resolve(schema["$ref"], root), root)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            rest = {k: v for k, v in schema.items() if k != key}
            merged = dict(rest)
            for part in (schema[key] if key == "allOf" else schema[key][:1]):
                merged.update(part)
            return instance(merged, root)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or "properties" in schema:
        return {k: instance(v, root) for k, v in schema.get("properties", {}).items()}
    if kind == "array":
        return [instance(schema.get("items", {}), root)] * max(1, schema.get("minItems", 1))
    return {"string": "text", "integer": 1, "number": 1.5, "boolean": True,
            "null": None}.get(kind, {})  # type: ignore[arg-type]


def answer(prompt: str, guided_json: Any) -> List[Optional[str]]:
    """The pieces (one per engine step) of the answer to ``prompt`` (``EOS``: the step of the
    end-of-sequence token)."""
    if guided_json is not None:
        schema = json.loads(guided_json) if isinstance(guided_json, str) else guided_json
        text = json.dumps(instance(schema))
        return [text[k:k + PIECE] for k in range(0, len(text), PIECE)]
    if "<|tools|>" in prompt:
        name = prompt.split("<|tools|>", 1)[1].split(";", 1)[0]
        args = json.dumps(ARGS.get(name, {"text": "x"}))
        return [f'<tool_call>{{"name": "{name}", "arguments": ', args[:-1], args[-1] + "}",
                "</tool_call>", EOS]
    return list(ANSWER)
