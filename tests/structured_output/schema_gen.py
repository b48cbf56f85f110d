"""A seeded generator of JSON schemas for the structured-output tests.

Nested objects, arrays, enums, bounded numbers and strings, required and optional fields; every
size is bounded so that a conforming output ends within a few hundred tokens even when a random
model picks its tokens.
"""

from __future__ import annotations

import random
from typing import Any

_WORDS = ["name", "id", "score", "tags", "meta", "kind", "size", "flag", "items", "note"]
_ENUM_VALUES: list[Any] = ["red", "green", "blue", "x y", 'say "hi"', 7, -3, 2.5, True, None]


def make_schema(rng: random.Random) -> dict[str, Any]:
    """One object schema (the top level of a response is an object, as in OpenAI's json_schema)."""
    return _object(rng, depth=0)


def make_schemas(num_schemas: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [make_schema(rng) for _ in range(num_schemas)]


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    num_props = rng.randint(1, 4 if depth == 0 else 2)
    keys = rng.sample(_WORDS, num_props)
    properties = {key: _value(rng, depth + 1) for key in keys}
    num_required = rng.randint(1 if depth == 0 else 0, num_props)
    return {"type": "object", "properties": properties, "required": rng.sample(keys, num_required),
            "additionalProperties": False}


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["integer", "number", "string", "enum", "boolean", "array"]
    if depth < 2:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        low = rng.randint(-20, 20)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 50)}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 6)}
    if kind == "enum":
        return {"enum": rng.sample(_ENUM_VALUES, rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        item_kinds = ("integer", "string", "enum", "boolean") if depth >= 2 else ("integer", "string", "enum", "object")
        item = _value_of(rng, rng.choice(item_kinds), depth + 1)
        return {"type": "array", "items": item, "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    return _object(rng, depth)


def _value_of(rng: random.Random, kind: str, depth: int) -> dict[str, Any]:
    if kind == "object":
        return _object(rng, depth)
    while True:
        value = _value(rng, 2)  # scalars only
        if value.get("type", "enum") == kind or ("enum" in value and kind == "enum"):
            return value
