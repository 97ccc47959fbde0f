"""Schema-typed conversion of tool-call parameter values.

Qwen3.5/3.6 write each argument as raw text between `<parameter=KEY>` tags (reference/serving.md §3.5); the
JSON type comes from the tool's parameter schema in the request: strings stay verbatim, integers and numbers
are parsed, booleans read `true`/`false`, objects and arrays are JSON. A value that does not parse as its
declared type is kept as the raw string rather than dropped, so the client still sees what the model wrote.
"""
from __future__ import annotations

import ast
import json
from typing import Any

_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_INTEGER_TYPES = {"integer", "int", "long", "short", "uint"}
_NUMBER_TYPES = {"number", "float", "double"}
_BOOLEAN_TYPES = {"boolean", "bool"}
_JSON_TYPES = {"object", "array", "dict", "list"}


def parameter_schema(tool_parameters: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    """The JSON schema of one argument, or None when the tool does not declare it."""
    if not isinstance(tool_parameters, dict):
        return None
    props = tool_parameters.get("properties")
    if isinstance(props, dict) and isinstance(props.get(key), dict):
        return props[key]
    return None


def _schema_types(schema: dict[str, Any]) -> list[str]:
    """Declared types in order: `type` (string or list), then the members of anyOf/oneOf."""
    types: list[str] = []
    declared = schema.get("type")
    if isinstance(declared, str):
        types.append(declared)
    elif isinstance(declared, list):
        types.extend(t for t in declared if isinstance(t, str))
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or []:
            if isinstance(member, dict):
                types.extend(_schema_types(member))
    if not types and "enum" in schema:
        types.append("enum")
    if not types and "properties" in schema:
        types.append("object")
    return [t.lower() for t in types]


_FAILED = object()


def _convert_as(value: str, type_name: str) -> Any:
    text = value.strip()
    if type_name in _STRING_TYPES:
        return value
    if type_name in _INTEGER_TYPES:
        try:
            return int(text)
        except ValueError:
            return _FAILED
    if type_name in _NUMBER_TYPES:
        try:
            return int(text)
        except ValueError:
            pass
        try:
            return float(text)
        except ValueError:
            return _FAILED
    if type_name in _BOOLEAN_TYPES:
        lowered = text.lower()
        if lowered in ("true", "1"):
            return True
        if lowered in ("false", "0"):
            return False
        return _FAILED
    if type_name in _JSON_TYPES:
        parsed = _parse_literal(text)
        expected = dict if type_name in ("object", "dict") else list
        return parsed if isinstance(parsed, expected) and _is_json_value(parsed) else _FAILED
    if type_name == "null":
        return None if text.lower() in ("null", "none") else _FAILED
    return _FAILED


def _parse_literal(text: str) -> Any:
    """JSON first, then a Python literal (models sometimes write single quotes or True/False)."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _FAILED


def convert_parameter(value: str, schema: dict[str, Any] | None) -> Any:
    """Raw parameter text -> JSON value according to `schema` (None: untyped)."""
    if value.strip().lower() == "null":
        return None
    types = _schema_types(schema) if schema else []
    for type_name in types:
        converted = _convert_as(value, type_name)
        if converted is not _FAILED:
            return converted
    if types:
        return value
    parsed = _parse_literal(value.strip())
    if parsed is _FAILED or not _is_json_value(parsed):
        return value
    return parsed


def _is_json_value(obj: Any) -> bool:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return True
    if isinstance(obj, list):
        return all(_is_json_value(v) for v in obj)
    if isinstance(obj, dict):
        return all(isinstance(k, str) and _is_json_value(v) for k, v in obj.items())
    return False
