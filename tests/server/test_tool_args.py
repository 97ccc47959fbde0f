"""Schema-typed conversion of raw tool-call parameter text (reference/serving.md §2.3)."""
from __future__ import annotations

import pytest

from ninfer_numba.server.tool_args import convert_parameter, parameter_schema

CASES = [
    ("Paris", {"type": "string"}, "Paris"),
    ("  12 ", {"type": "string"}, "  12 "),
    ("12", {"type": "integer"}, 12),
    ("-7", {"type": "integer"}, -7),
    ("twelve", {"type": "integer"}, "twelve"),
    ("2.5", {"type": "number"}, 2.5),
    ("3", {"type": "number"}, 3),
    ("1e3", {"type": "number"}, 1000.0),
    ("true", {"type": "boolean"}, True),
    ("False", {"type": "boolean"}, False),
    ("maybe", {"type": "boolean"}, "maybe"),
    ('{"a": 1}', {"type": "object"}, {"a": 1}),
    ("{'a': True}", {"type": "object"}, {"a": True}),
    ("[1, 2]", {"type": "array"}, [1, 2]),
    ("[1, 2]", {"type": "object"}, "[1, 2]"),
    ("null", {"type": "string"}, None),
    ("5", {"type": ["integer", "null"]}, 5),
    ("x", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "x"),
    ("4", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 4),
    ("red", {"enum": ["red", "blue"]}, "red"),
    ("7", None, 7),
    ("[true]", None, [True]),
    ("hello world", None, "hello world"),
    ("{1, 2}", None, "{1, 2}"),
]


@pytest.mark.parametrize("raw,schema,expected", CASES, ids=[f"{c[0]!r}-{c[1]}" for c in CASES])
def test_convert_parameter(raw, schema, expected):
    got = convert_parameter(raw, schema)
    assert got == expected and type(got) is type(expected)


def test_parameter_schema_lookup():
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    assert parameter_schema(params, "city") == {"type": "string"}
    assert parameter_schema(params, "other") is None
    assert parameter_schema(None, "city") is None
