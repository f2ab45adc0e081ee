"""Hypothesis strategies for the JSON Schema subset GET /openapi.json uses: values the document allows.

Covers ``type`` (one or a list), ``enum``, ``const``, ``anyOf`` / ``oneOf``, objects
(``properties``, ``required``; optional properties drawn or left out; ``additionalProperties``
with ``propertyNames`` of digits, as ``logit_bias``), arrays (``items``, ``minItems``,
``maxItems``, ``uniqueItems``), numbers and integers with their bounds, strings with
``minLength`` / ``maxLength`` (a ``pattern`` of ``\\S`` means not blank). Sizes stay small:
the point is every shape, not big bodies.
"""

from __future__ import annotations

from hypothesis import strategies as st

MAX_TEXT = 40
MAX_LIST = 4

_ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _string(schema: dict) -> st.SearchStrategy:
    lo = schema.get("minLength", 0)
    hi = max(lo, min(schema.get("maxLength", MAX_TEXT), MAX_TEXT))
    text = st.text(st.characters(codec="utf-8"), min_size=lo, max_size=hi)
    if schema.get("pattern") == "\\S":
        text = text.filter(str.strip)
    return text


def _number(schema: dict, integer: bool) -> st.SearchStrategy:
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if integer:
        return st.integers(min_value=lo, max_value=hi)
    low = schema.get("exclusiveMinimum", lo)
    return st.floats(
        min_value=low, max_value=hi, exclude_min="exclusiveMinimum" in schema, allow_nan=False, allow_infinity=False
    )


def _object(schema: dict) -> st.SearchStrategy:
    props = schema.get("properties", {})
    required = set(schema.get("required", []))
    if not props and isinstance(schema.get("additionalProperties"), dict):  # a map, as logit_bias
        keys = st.integers(0, 50_000).map(str)
        return st.dictionaries(keys, from_schema(schema["additionalProperties"]), max_size=MAX_LIST)
    if not props:
        return st.dictionaries(st.text(max_size=6), _ANY, max_size=3)
    fixed = {k: from_schema(v) for k, v in props.items() if k in required}
    optional = {k: from_schema(v) for k, v in props.items() if k not in required}
    return st.fixed_dictionaries(fixed, optional=optional)


def _array(schema: dict) -> st.SearchStrategy:
    lo = schema.get("minItems", 0)
    hi = max(lo, min(schema.get("maxItems", MAX_LIST), max(MAX_LIST, lo)))
    items = from_schema(schema.get("items", {}))
    return st.lists(
        items, min_size=lo, max_size=hi, unique_by=(lambda x: repr(x)) if schema.get("uniqueItems") else None
    )


def from_schema(schema: dict) -> st.SearchStrategy:
    """Values valid under ``schema`` (for the subset above; anything else: any JSON value)."""
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s) for s in schema[key]])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}) for k in kind])
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind in ("integer", "number"):
        return _number(schema, kind == "integer")
    if kind == "string":
        return _string(schema)
    if kind == "array":
        return _array(schema)
    if kind == "object" or "properties" in schema:
        return _object(schema)
    return _ANY
