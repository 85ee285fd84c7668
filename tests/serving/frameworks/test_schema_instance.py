"""The engine stand-in's schema instances (schema_instance.py): every instance validates under its
schema (jsonschema) and, for pydantic's schemas, as the model; what cannot be satisfied
exactly is refused.  Runs in the frameworks session (its vLLM venv has pydantic 2 and
jsonschema, both vLLM 0.6.3 dependencies; the tests import them)."""

from __future__ import annotations

import datetime
import enum
import os
import sys
import uuid
from typing import Dict, List, Literal, Optional, Tuple, Union

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from schema_instance import Unsupported, instance  # noqa: E402

pytestmark = pytest.mark.frameworks

def _models():
    """pydantic models whose schemas have what pydantic emits (imported here: the unit session
    collects this module without pydantic and deselects it by its marker)."""
    from pydantic import BaseModel, Field

    class Colour(str, enum.Enum):
        red = "red"
        blue = "blue"

    class Point(BaseModel):
        x: int = Field(ge=-5, le=-2)
        y: float = Field(gt=0.5, lt=2)

    class Circle(BaseModel):
        kind: Literal["circle"]
        centre: Point
        radius: float = Field(ge=1)

    class Square(BaseModel):
        kind: Literal["square"]
        side: int

    class Everything(BaseModel):
        name: str = Field(min_length=12, max_length=14)
        code: str = Field(max_length=3)
        colour: Colour
        shape: Union[Circle, Square]
        shapes: List[Square] = Field(min_length=2)
        pair: Tuple[int, str]
        counts: Dict[str, int]
        when: datetime.datetime
        day: datetime.date
        ident: uuid.UUID
        flag: bool
        maybe: Optional[Point] = None
        tags: List[str] = []

    class Tree(BaseModel):
        label: str
        children: List["Tree"] = []

    Tree.model_rebuild()
    return {m.__name__: m for m in (Point, Circle, Everything, Tree)}


@pytest.mark.parametrize("name", ["Point", "Circle", "Everything", "Tree"])
def test_an_instance_of_a_pydantic_schema_is_a_valid_model(name):
    import jsonschema

    model = _models()[name]
    schema = model.model_json_schema()
    got = instance(schema)
    jsonschema.validate(got, schema)
    model.model_validate(got)
    assert instance(schema) == got  # deterministic


def test_strings_say_where_they_stand():
    got = instance(_models()["Everything"].model_json_schema())
    assert got["shapes"][1]["kind"] == "square" and got["tags"] == ["tags.0"]
    assert len(got["name"]) == 12 and got["name"].startswith("name") and got["code"] == "cod"
    assert got["counts"] == {} and got["pair"] == [3, "pair.1"]
    assert instance({"type": "string"}) == "value"


def test_a_recursive_model_ends():
    got = instance(_models()["Tree"].model_json_schema())
    depth = 0
    while got["children"]:
        got, depth = got["children"][0], depth + 1
    assert 1 < depth <= 6


#: What upstream vLLM (#13483) guides a ``tool_choice: "required"`` answer with: a list of
#: calls of any of the tools, each ``{"name", "parameters"}``.
REQUIRED = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
    {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                    "parameters": {"type": "object", "properties": {
                        "city": {"type": "string"}}, "required": ["city"],
                        "additionalProperties": False}},
     "required": ["name", "parameters"]},
    {"properties": {"name": {"type": "string", "enum": ["final_result"]},
                    "parameters": {"$ref": "#/$defs/Point"}},
     "required": ["name", "parameters"]}]},
    "$defs": {"Point": {"type": "object", "required": ["x", "y"], "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": -2},
        "y": {"type": "number", "exclusiveMinimum": 0.5, "exclusiveMaximum": 2}}}}}


@pytest.mark.parametrize("schema", [
    REQUIRED,
    {"type": "object", "properties": {"a": {"type": ["string", "null"]},
                                      "b": {"allOf": [{"$ref": "#/definitions/P"}]}},
     "required": ["a", "b"], "additionalProperties": False,
     "definitions": {"P": {"type": "object", "properties": {"q": {"const": 7}},
                           "required": ["q"]}}},
    {"type": "object", "required": ["free"], "minProperties": 2},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}],
     "items": False},
    {"type": "number", "exclusiveMinimum": -3.5, "maximum": -1},
    {"type": "integer", "minimum": 2.5},
    True,
    {},
])
def test_an_instance_validates_under_its_schema(schema):
    import jsonschema

    jsonschema.validate(instance(schema), schema)


def test_references_through_arrays_and_escapes_resolve():
    """The shape of ``tool_choice: "required"`` since issue 39: each tool's own references
    rewritten to its place in the calls' array (``#/items/anyOf/0/...``), names escaped."""
    schema = {"type": "array", "items": {"anyOf": [{"type": "object", "properties": {
        "parameters": {"$defs": {"a b": {"type": "integer", "minimum": 3}},
                       "type": "object", "properties": {
                           "n": {"$ref": "#/items/anyOf/0/properties/parameters/$defs/a%20b"}},
                       "required": ["n"]}}, "required": ["parameters"]}]},
              "minItems": 1}
    import jsonschema

    value = instance(schema)
    assert value[0]["parameters"]["n"] >= 3
    jsonschema.validate(value, schema)


def test_required_answers_a_call_of_the_first_tool():
    assert instance(REQUIRED) == [{"name": "get_weather",
                                   "parameters": {"city": "0.parameters.city"}}]


@pytest.mark.parametrize("schema, why", [
    ({"type": "string", "pattern": "^[a-z]+$"}, "pattern"),
    ({"$ref": "#/$defs/Missing"}, "does not resolve"),
    ({"$ref": "other.json#/x"}, "outside"),
    ({"type": "integer", "minimum": 3, "maximum": 2}, "no integer"),
    ({"type": "array", "items": {"type": "boolean"}, "minItems": 2, "uniqueItems": True},
     "uniqueItems"),
    ({"type": "string", "format": "date-time", "maxLength": 4}, "maxLength"),
    ({"type": "object", "minProperties": 1, "additionalProperties": False}, "minProperties"),
])
def test_what_cannot_be_satisfied_exactly_is_refused(schema, why):
    with pytest.raises(Unsupported, match=why):
        instance(schema)
