"""JSON Schema (the subset tools and tasks need) to pydantic models.

Profiles written as data (YAML) describe their task and tool arguments in JSON Schema;
the workflow validates with pydantic. Only what guided decoding and strict tool
schemas handle well is accepted, and anything else is refused with the path of the
offending keyword, so a profile never loads with a schema that silently means less
than it says.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

_COMMON = {"type", "description", "title", "default", "examples"}
_ALLOWED = {
    "object": _COMMON | {"properties", "required", "additionalProperties"},
    "string": _COMMON | {"enum", "pattern", "minLength", "maxLength", "const"},
    "integer": _COMMON | {"enum", "minimum", "maximum", "exclusiveMinimum",
                          "exclusiveMaximum", "multipleOf", "const"},
    "number": _COMMON | {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                         "multipleOf", "const"},
    "boolean": _COMMON | {"const"},
    "array": _COMMON | {"items", "minItems", "maxItems", "uniqueItems"},
}
_BOUNDS = {"minimum": "ge", "maximum": "le", "exclusiveMinimum": "gt",
           "exclusiveMaximum": "lt", "multipleOf": "multiple_of", "minLength": "min_length",
           "maxLength": "max_length", "minItems": "min_length", "maxItems": "max_length",
           "pattern": "pattern"}
_SCALARS: dict[str, type] = {"string": str, "integer": int, "number": float, "boolean": bool}


class SchemaError(ValueError):
    """A schema uses something the converter refuses; the message starts with its path."""


def _model_name(name: str) -> str:
    return re.sub(r"\W", "_", name.title().replace("-", "")) or "Model"


def model_from_schema(name: str, schema: Any, *, where: str, strict_tool: bool = False
                      ) -> type[BaseModel]:
    """A pydantic model (``extra="forbid"``) for an object schema.

    ``strict_tool``: the schema is a tool's arguments, sent to the engine as a strict
    function schema, so every property must be required (strict mode has no optional
    arguments) and every string bounded (an enum or a pattern)."""
    if not isinstance(schema, dict):
        raise SchemaError(f"{where}: expected a JSON Schema object, got {type(schema).__name__}")
    if schema.get("type", "object") != "object":
        raise SchemaError(f"{where}.type: must be 'object'")
    return _object_model(name, schema, where, strict_tool)


def _object_model(name: str, schema: dict[str, Any], where: str, strict: bool
                  ) -> type[BaseModel]:
    _check_keys(schema, "object", where)
    if schema.get("additionalProperties", False) is not False:
        raise SchemaError(f"{where}.additionalProperties: must be false (unknown fields are "
                          "refused, never passed on)")
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise SchemaError(f"{where}.properties: expected a mapping of name to schema")
    required = schema.get("required", [])
    unknown = sorted(set(required) - set(props))
    if unknown:
        raise SchemaError(f"{where}.required: names no property {', '.join(unknown)}")
    fields: dict[str, Any] = {}
    for prop, sub in props.items():
        path = f"{where}.properties.{prop}"
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", prop):
            raise SchemaError(f"{path}: property names must be identifiers")
        annotation = _annotation(f"{name}_{prop}", sub, path, strict)
        if prop in required:
            fields[prop] = (annotation, ...)
        elif strict:
            raise SchemaError(f"{path}: every tool argument must be required (strict tool "
                              "schemas have no optional arguments; use an enum with a "
                              "'none' value instead)")
        else:
            fields[prop] = (annotation | None, sub.get("default"))
    try:
        model: type[BaseModel] = create_model(  # type: ignore[call-overload]
            _model_name(name), __config__=ConfigDict(extra="forbid"),
            __doc__=schema.get("description"), **fields)
    except Exception as e:  # pydantic refuses a combination the checks above let by
        raise SchemaError(f"{where}: {' '.join(str(e).split())}") from None
    return model


def _check_keys(schema: dict[str, Any], kind: str, where: str) -> None:
    extra = sorted(set(schema) - _ALLOWED[kind])
    if extra:
        raise SchemaError(f"{where}.{extra[0]}: not supported for type {kind!r} "
                          f"(supported: {', '.join(sorted(_ALLOWED[kind] - _COMMON))})")


def _annotation(name: str, schema: Any, where: str, strict: bool) -> Any:
    if not isinstance(schema, dict):
        raise SchemaError(f"{where}: expected a schema object")
    kind = schema.get("type")
    if kind is None and "enum" in schema:
        kind = "string"
    if kind not in _ALLOWED:
        raise SchemaError(f"{where}.type: expected one of {', '.join(_ALLOWED)}, got {kind!r}")
    _check_keys(schema, kind, where)
    if kind == "object":
        return _object_model(name, schema, where, strict)
    field_kw: dict[str, Any] = {"description": schema.get("description")}
    for key, kw in _BOUNDS.items():
        if key in schema:
            value = schema[key]
            wanted = str if key == "pattern" else (int if "Length" in key or "Items" in key
                                                   else (int, float))
            if isinstance(value, bool) or not isinstance(value, wanted):
                raise SchemaError(f"{where}.{key}: expected a "
                                  f"{'string' if wanted is str else 'number'}, got {value!r}")
            field_kw[kw] = value
    if kind == "array":
        if "items" not in schema:
            raise SchemaError(f"{where}.items: an array needs an items schema")
        inner = _annotation(f"{name}_item", schema["items"], f"{where}.items", strict)
        return Annotated[list[inner], Field(**field_kw)]  # type: ignore[valid-type]
    if "const" in schema:
        return Literal[schema["const"]]
    if "enum" in schema:
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError(f"{where}.enum: expected a non-empty list")
        return Literal[tuple(values)]
    if strict and kind == "string" and "pattern" not in schema:
        raise SchemaError(f"{where}: unbounded string; give it an enum or a pattern, or a "
                          "weak model rambles to max_tokens under guided decoding")
    if kind == "string" and "pattern" in schema:
        try:
            re.compile(schema["pattern"])
        except re.error as e:
            raise SchemaError(f"{where}.pattern: not a valid regular expression: {e}") from None
    return Annotated[_SCALARS[kind], Field(**field_kw)]
