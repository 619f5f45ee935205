"""Filters over item metadata, for filtered vector search: one JSON form for the HTTP API, CLI and Python.

The language (``parse_filter`` reads it, ``Filter.to_json`` writes its canonical form):

- ``{"category": "boots"}``: the column equals the value; several keys in one object are ANDed.
- ``{"price": {"gte": 10, "lt": 50}}``: operators eq, ne, gt, gte, lt, lte, in (a non-empty list) and
  exists (true/false); several in one object are ANDed.
- ``{"and": [f, ...]}``, ``{"or": [f, ...]}`` (non-empty lists), ``{"not": f}``. ``and``, ``or`` and
  ``not`` are operators, never column names.
- At most ``MAX_NODES`` conditions and operators, objects nested at most ``MAX_DEPTH`` deep (a request
  may be hostile).

Types (``column_types``): "string", "number" (any integer or float column; 1 equals 1.0), "boolean",
and "json" (nested objects or lists, or any Arrow type filters cannot compare), which takes only
``exists``. Ranges need a number column; eq, ne and in take values of the column's type, and true is
a boolean, never the number 1. ``parse_filter`` checks structure only; ``check_filter`` holds a
filter against a table's column types.

Missing values (a row without the key, or with null) match no comparison: eq, ne, in and the ranges
are all false there; ``{"exists": false}`` asks for them. Every filter is two-valued (missing is
false, not SQL's unknown) and ``not`` negates that: ``{"not": {"price": {"lt": 50}}}`` matches rows
priced 50 or more *and* rows without a price. ``evaluate`` treats a column that its table lacks, or
holds with a type other than the filter value's (another shard), as missing: it never raises there.

Where each part lives: this module reads and checks filters; the parsed tree is
``puma.index.filter_tree``, evaluation on Arrow columns and the column types ``puma.index.filter_eval``,
and the typing of item metadata JSON into columns (``metadata_columns``) ``puma.index.metadata``. Their
public names are importable from here too.
"""

from __future__ import annotations

import json
import math
from typing import Any

from puma.errors import UserError
from puma.index.filter_eval import column_type, column_types, describe_columns, evaluate
from puma.index.filter_tree import And, Condition, Filter, Joined, Not, Or, shown, value_kind
from puma.index.metadata import JSON_TYPE, MetadataError, metadata_columns

__all__ = ["And", "Condition", "Filter", "FilterError", "JSON_TYPE", "Joined", "MetadataError", "Not", "Or",
           "check_filter", "column_type", "column_types", "describe_columns", "evaluate", "metadata_columns",
           "parse_filter"]

MAX_NODES = 64  # conditions plus and/or/not operators in one filter
MAX_DEPTH = 8  # filter objects nested in one another (the whole filter is depth 1)
MAX_NAMES_SHOWN = 30  # known column names listed in an unknown-column error
LOGIC_KEYS = ("and", "or", "not")
RANGE_OPS = ("gt", "gte", "lt", "lte")
OPS = ("eq", "ne", *RANGE_OPS, "in", "exists")
OPS_BY_TYPE = {
    "string": ("eq", "ne", "in", "exists"),
    "number": OPS,
    "boolean": ("eq", "ne", "in", "exists"),
    "json": ("exists",),
}
WHAT_A_TYPE_TAKES = {
    "string": 'eq, ne and in with strings (e.g. "boots"), and exists (true/false)',
    "number": "eq, ne, gt, gte, lt, lte and in with numbers (e.g. 50, 9.99), and exists (true/false)",
    "boolean": "eq, ne and in with true/false, and exists (true/false)",
    "json": "only exists (true/false): its values are nested JSON objects or lists",
}
EXAMPLE = '{"and": [{"category": "boots"}, {"price": {"lt": 50}}]}'
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class FilterError(UserError, ValueError):
    """A filter that is malformed, or names a column or value its table cannot take."""


# ----------------------------------------------------------------------------- parsing


def parse_filter(obj: Any) -> Filter:
    """The filter of a JSON object (or its JSON text); checks structure and values, not columns."""
    if isinstance(obj, Filter):
        return obj
    if isinstance(obj, (str, bytes)):
        obj = _decoded(obj)
    return _Parser().filter(obj, "", 1)


def _decoded(text: str | bytes) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise FilterError(f"filter: not valid JSON ({e}); write an object such as {EXAMPLE}") from None


class _Parser:
    """Reads one JSON filter, counting its conditions and operators against MAX_NODES."""

    def __init__(self) -> None:
        self.nodes = 0

    def filter(self, obj: Any, path: str, depth: int) -> Filter:
        if depth > MAX_DEPTH:
            raise FilterError(f"{_where(path)}: filters nest at most {MAX_DEPTH} deep; flatten this one "
                              "(an 'and' inside an 'and' is one 'and')")
        if not isinstance(obj, dict) or not obj:
            raise FilterError(f"{_where(path)}: a filter is a non-empty JSON object such as {EXAMPLE}; "
                              f"got {shown(obj)}")
        parts = [self._entry(key, value, path, depth) for key, value in obj.items()]
        return parts[0] if len(parts) == 1 else And(tuple(parts))

    def _entry(self, key: Any, value: Any, path: str, depth: int) -> Filter:
        if not isinstance(key, str) or not key:
            raise FilterError(f"{_where(path)}: key {key!r} is not a column name; keys are non-empty "
                              "strings: a column, or and/or/not")
        if key in LOGIC_KEYS:
            return self._logic(key, value, _join(path, key), depth)
        return self._column(key, value, _join(path, key))

    def _logic(self, op: str, value: Any, path: str, depth: int) -> Filter:
        self._count(path)
        if op == "not":
            return Not(self.filter(value, path, depth + 1))
        if not isinstance(value, list) or not value:
            raise FilterError(f'{_where(path)}: "{op}" takes a non-empty list of filters, e.g. '
                              f'{{"{op}": [{{"category": "boots"}}, {{"price": {{"lt": 50}}}}]}}; '
                              f"got {shown(value)}")
        parts = tuple(self.filter(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
        return And(parts) if op == "and" else Or(parts)

    def _column(self, column: str, value: Any, path: str) -> Filter:
        if not isinstance(value, dict):
            return self._condition(column, "eq", value, path, path)
        if not value:
            raise FilterError(f"{_where(path)}: no operator; give one of {', '.join(OPS)}, "
                              f'e.g. {{"{column}": {{"eq": ...}}}}')
        parts = [self._condition(column, op, v, path, _join(path, str(op))) for op, v in value.items()]
        return parts[0] if len(parts) == 1 else And(tuple(parts))

    def _condition(self, column: str, op: Any, value: Any, path: str, value_path: str) -> Condition:
        self._count(path)
        if op not in OPS:
            raise FilterError(f"{_where(value_path)}: unknown operator {op!r} on column {column!r}; "
                              f"valid operators: {', '.join(OPS)}")
        return Condition(column, op, _parsed_value(op, value, value_path), path=path)

    def _count(self, path: str) -> None:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise FilterError(f"{_where(path)}: a filter holds at most {MAX_NODES} conditions and "
                              "and/or/not operators; use 'in' for a list of values, or split the query")


def _parsed_value(op: str, value: Any, path: str) -> Any:
    """The value of ``op``, checked and made canonical (integral floats as ints, 'in' lists sorted)."""
    if op == "exists":
        if not isinstance(value, bool):
            raise FilterError(f"{_where(path)}: exists takes true or false; got {shown(value)}")
        return value
    if op == "in":
        return _in_values(value, path)
    scalar = _scalar(value, path)
    if op in RANGE_OPS and value_kind(scalar) != "number":
        raise FilterError(f"{_where(path)}: {op} takes a number; got {shown(value)} (a {value_kind(scalar)})")
    return scalar


def _in_values(value: Any, path: str) -> tuple:
    if not isinstance(value, list) or not value:
        raise FilterError(f'{_where(path)}: in takes a non-empty list of values, e.g. {{"in": ["a", "b"]}}; '
                          f"got {shown(value)}")
    values = [_scalar(v, f"{path}[{i}]") for i, v in enumerate(value)]
    kinds = sorted({value_kind(v) for v in values})
    if len(kinds) > 1:
        raise FilterError(f"{_where(path)}: in takes values of one kind (all strings, all numbers or all "
                          f"true/false); got {' and '.join(kinds)} values")
    return tuple(sorted(set(values)))


def _scalar(value: Any, path: str) -> str | int | float | bool:
    if isinstance(value, (str, bool)):
        return value
    if isinstance(value, (int, float)):
        return _number(value, path)
    if value is None:
        raise FilterError(f'{_where(path)}: null matches nothing; use {{"exists": false}} for rows '
                          "without a value")
    if isinstance(value, list):
        raise FilterError(f'{_where(path)}: a list is not a value; use {{"in": {shown(value)}}} to match '
                          "any of several values")
    raise FilterError(f"{_where(path)}: expected a string, number or true/false; got {shown(value)}")


def _number(value: int | float, path: str) -> int | float:
    """Finite; a float with no fraction (within int64) becomes an int, so 1.0 and 1 are one filter."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise FilterError(f"{_where(path)}: numbers must be finite; got {value}")
        return int(value) if value.is_integer() and INT64_MIN <= value <= INT64_MAX else value
    return value if INT64_MIN <= value <= INT64_MAX else float(value)



def _join(path: str, key: str) -> str:
    """``and[1].price``; a key that is not a plain name as ``["unit price"]``."""
    if not key.isidentifier():
        return f"{path}{json.dumps([key], ensure_ascii=False)}"
    return f"{path}.{key}" if path else key


def _where(path: str) -> str:
    return f"filter at {path}" if path else "filter"


# ----------------------------------------------------------------------------- checking


def check_filter(f: Filter, types: dict[str, str], unknown_ok: bool = False) -> None:
    """Raise FilterError unless every column ``f`` names is in ``types`` and takes its op and value
    (``unknown_ok``: conditions on columns not in ``types`` are not checked; they match nothing)."""
    for condition in f.conditions():
        if not (unknown_ok and condition.column not in types):
            _check_condition(condition, types)


def _check_condition(c: Condition, types: dict[str, str]) -> None:
    where = _where(c.path or _join("", c.column))
    if c.column not in types:
        raise FilterError(f"{where}: no column {c.column!r}; known columns: {_known_names(types)}")
    column_type = types[c.column]
    if column_type not in OPS_BY_TYPE:
        raise ValueError(f"column type {column_type!r} of {c.column!r} is not one of "
                         f"{', '.join(OPS_BY_TYPE)}; column_types(table) gives valid types")
    if c.op not in OPS_BY_TYPE[column_type] or (c.op != "exists" and value_kind(c.value) != column_type):
        got = f"{c.op} {shown(c.value)}" + ("" if c.op == "exists" else f" (a {value_kind(c.value)})")
        raise FilterError(f"{where}: {c.column!r} is a {column_type} column and takes "
                          f"{WHAT_A_TYPE_TAKES[column_type]}; got {got}")


def _known_names(types: dict[str, str]) -> str:
    names = sorted(types)
    if not names:
        return "none (the items have no metadata)"
    listed = ", ".join(names[:MAX_NAMES_SHOWN])
    return listed if len(names) <= MAX_NAMES_SHOWN else f"{listed}, ... ({len(names)} in all)"

