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

Metadata (``metadata_columns``): Arrow's C++ JSON reader types one JSON object per row. Numbers stay
numbers (int64; float64 when a value has a fraction or exceeds int64), true/false become booleans,
strings stay strings (ISO dates too: Arrow's timestamp guess is undone); a key that is null in every
row gives no column. When Arrow cannot type the rows (a column mixes kinds) or a column is nested, all
rows are read again with Python's json module under the same rules, plus, per column:

- any object or list value: a "json" column (``arrow.json`` extension type) of each value's compact
  JSON text with sorted keys;
- strings, numbers and booleans mixed (no objects or lists): a "string" column, strings as they are,
  numbers and booleans as their JSON text (7 -> "7", 2.5 -> "2.5", true -> "true").
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from puma.errors import UserError

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
JSON_TYPE = pa.json_(pa.string())  # the "json" columns of metadata_columns
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_COMPARE = {"eq": pc.equal, "ne": pc.not_equal, "gt": pc.greater, "gte": pc.greater_equal,
            "lt": pc.less, "lte": pc.less_equal}


class FilterError(UserError, ValueError):
    """A filter that is malformed, or names a column or value its table cannot take."""


class MetadataError(UserError, ValueError):
    """A metadata row that is not a JSON object (nor null or empty)."""


# ----------------------------------------------------------------------------- the filter tree


class Filter:
    """A parsed filter: immutable, hashable, equal to another with the same canonical ``key``."""

    def to_json(self) -> dict:
        """The canonical JSON form (and/or parts flattened, sorted, deduplicated)."""
        raise NotImplementedError

    def conditions(self) -> Iterator[Condition]:
        """Every column condition in the tree."""
        raise NotImplementedError

    def columns(self) -> frozenset[str]:
        """The columns the filter names."""
        return frozenset(c.column for c in self.conditions())

    @cached_property
    def key(self) -> str:
        """Canonical JSON text, the same for equivalent spellings: a cache key for selections."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Filter) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


@dataclass(frozen=True, eq=False)
class Condition(Filter):
    """``column op value``; value is str, int, float or bool, a sorted tuple of them for ``in``."""

    column: str
    op: str
    value: Any
    path: str = field(default="", repr=False)  # where the request wrote it, for error messages

    def to_json(self) -> dict:
        value = list(self.value) if self.op == "in" else self.value
        return {self.column: {self.op: value}}

    def conditions(self) -> Iterator[Condition]:
        yield self


@dataclass(frozen=True, eq=False)
class Joined(Filter):
    """Parts joined by ``OP`` (And, Or)."""

    parts: tuple[Filter, ...]
    OP: ClassVar[str] = ""

    def to_json(self) -> dict:
        return _joined_json(self.OP, self.parts)

    def conditions(self) -> Iterator[Condition]:
        for part in self.parts:
            yield from part.conditions()


class And(Joined):
    """Every part matches."""

    OP = "and"


class Or(Joined):
    """At least one part matches."""

    OP = "or"


@dataclass(frozen=True, eq=False)
class Not(Filter):
    """The part does not match (a missing value counts as not matching, so ``not`` matches it)."""

    part: Filter

    def to_json(self) -> dict:
        inner = self.part.to_json()
        return inner["not"] if list(inner) == ["not"] else {"not": inner}

    def conditions(self) -> Iterator[Condition]:
        yield from self.part.conditions()


def _joined_json(op: str, parts: tuple[Filter, ...]) -> dict:
    """``{op: [...]}`` with nested ``op`` lists flattened, sorted and deduplicated; one part alone."""
    items = []
    for part in parts:
        inner = part.to_json()
        items.extend(inner[op] if list(inner) == [op] else [inner])
    unique = {json.dumps(item, sort_keys=True, ensure_ascii=False): item for item in items}
    ordered = [unique[text] for text in sorted(unique)]
    return ordered[0] if len(ordered) == 1 else {op: ordered}


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
                              f"got {_shown(obj)}")
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
                              f"got {_shown(value)}")
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
            raise FilterError(f"{_where(path)}: exists takes true or false; got {_shown(value)}")
        return value
    if op == "in":
        return _in_values(value, path)
    scalar = _scalar(value, path)
    if op in RANGE_OPS and _kind(scalar) != "number":
        raise FilterError(f"{_where(path)}: {op} takes a number; got {_shown(value)} (a {_kind(scalar)})")
    return scalar


def _in_values(value: Any, path: str) -> tuple:
    if not isinstance(value, list) or not value:
        raise FilterError(f'{_where(path)}: in takes a non-empty list of values, e.g. {{"in": ["a", "b"]}}; '
                          f"got {_shown(value)}")
    values = [_scalar(v, f"{path}[{i}]") for i, v in enumerate(value)]
    kinds = sorted({_kind(v) for v in values})
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
        raise FilterError(f'{_where(path)}: a list is not a value; use {{"in": {_shown(value)}}} to match '
                          "any of several values")
    raise FilterError(f"{_where(path)}: expected a string, number or true/false; got {_shown(value)}")


def _number(value: int | float, path: str) -> int | float:
    """Finite; a float with no fraction (within int64) becomes an int, so 1.0 and 1 are one filter."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise FilterError(f"{_where(path)}: numbers must be finite; got {value}")
        return int(value) if value.is_integer() and INT64_MIN <= value <= INT64_MAX else value
    return value if INT64_MIN <= value <= INT64_MAX else float(value)


def _kind(value: Any) -> str:
    """The filter type a value (or the first of an 'in' tuple) compares with."""
    if isinstance(value, tuple):
        value = value[0]
    if isinstance(value, bool):
        return "boolean"
    return "string" if isinstance(value, str) else "number"


def _join(path: str, key: str) -> str:
    """``and[1].price``; a key that is not a plain name as ``["unit price"]``."""
    if not key.isidentifier():
        return f"{path}{json.dumps([key], ensure_ascii=False)}"
    return f"{path}.{key}" if path else key


def _where(path: str) -> str:
    return f"filter at {path}" if path else "filter"


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
    if c.op not in OPS_BY_TYPE[column_type] or (c.op != "exists" and _kind(c.value) != column_type):
        got = f"{c.op} {_shown(c.value)}" + ("" if c.op == "exists" else f" (a {_kind(c.value)})")
        raise FilterError(f"{where}: {c.column!r} is a {column_type} column and takes "
                          f"{WHAT_A_TYPE_TAKES[column_type]}; got {got}")


def _known_names(types: dict[str, str]) -> str:
    names = sorted(types)
    if not names:
        return "none (the items have no metadata)"
    shown = ", ".join(names[:MAX_NAMES_SHOWN])
    return shown if len(names) <= MAX_NAMES_SHOWN else f"{shown}, ... ({len(names)} in all)"


# ----------------------------------------------------------------------------- evaluation


def evaluate(f: Filter, table: pa.Table) -> np.ndarray:
    """Which rows of ``table`` match: bool, ``table.num_rows`` long (missing values: see the module)."""
    if isinstance(f, Condition):
        return _condition_rows(f, table)
    if isinstance(f, Not):
        return ~evaluate(f.part, table)
    if isinstance(f, Joined):
        combine = np.logical_and if isinstance(f, And) else np.logical_or
        return functools.reduce(combine, (evaluate(part, table) for part in f.parts))
    raise TypeError(f"expected a Filter from parse_filter, got {type(f).__name__}")


def _condition_rows(c: Condition, table: pa.Table) -> np.ndarray:
    if c.column not in table.schema.names:
        present = np.zeros(table.num_rows, dtype=bool)  # another shard's column: missing everywhere
        return ~present if c.op == "exists" and not c.value else present
    chunks = table.column(c.column).chunks
    if not chunks:
        return np.zeros(table.num_rows, dtype=bool)
    return np.concatenate([_chunk_rows(c, chunk) for chunk in chunks])


def _chunk_rows(c: Condition, values: pa.Array) -> np.ndarray:
    if c.op == "exists":
        present = _present_rows(values)
        return present if c.value else ~present
    if pa.types.is_dictionary(values.type):  # once per distinct value, then spread by the codes
        per_entry = pa.array(_chunk_rows(c, values.dictionary))
        return _true_rows(pc.take(per_entry, values.indices))
    return _true_rows(_compared(c, values))


def _present_rows(values: pa.Array) -> np.ndarray:
    """Rows holding a value (a null code, or a code of a null dictionary entry, holds none)."""
    if pa.types.is_dictionary(values.type):
        return _true_rows(pc.take(pa.array(_present_rows(values.dictionary)), values.indices))
    return _true_rows(pc.is_valid(values))


def _compared(c: Condition, values: pa.Array) -> pa.Array:
    """``values op c.value`` as booleans (null where a value is missing); ``op`` is not exists."""
    if column_type(values.type) != _kind(c.value):
        return pa.nulls(len(values), pa.bool_())
    if pa.types.is_string_view(values.type):  # no comparison kernels for string_view
        values = values.cast(pa.large_string())
    if c.op == "in":
        return pc.is_in(values, value_set=_value_set(c.value, values.type))
    return _COMPARE[c.op](values, c.value)


def _value_set(values: tuple, arrow_type: pa.DataType) -> pa.Array:
    """'in' values for a column of ``arrow_type``: an integer column can only equal the int values."""
    if pa.types.is_integer(arrow_type):
        return pa.array([v for v in values if isinstance(v, int)], pa.int64())
    if pa.types.is_floating(arrow_type):
        return pa.array([float(v) for v in values], pa.float64())
    return pa.array(values)


def _true_rows(mask: pa.Array) -> np.ndarray:
    """A boolean Arrow array as numpy bools, null as False: its value and validity bitmaps unpacked
    (about 10x faster than fill_null then to_numpy on a 250k-row shard)."""
    validity, values = mask.buffers()
    if values is None or mask.null_count == len(mask):
        return np.zeros(len(mask), dtype=bool)
    rows = _bits(values, mask.offset, len(mask))
    if mask.null_count:
        rows &= _bits(validity, mask.offset, len(mask))
    return rows


def _bits(buffer: pa.Buffer, offset: int, length: int) -> np.ndarray:
    """``length`` bits of a little-endian Arrow bitmap from bit ``offset``, as numpy bools."""
    packed = np.frombuffer(buffer, dtype=np.uint8)
    return np.unpackbits(packed, count=offset + length, bitorder="little")[offset:].view(bool)


# ----------------------------------------------------------------------------- columns and metadata


def column_type(arrow_type: pa.DataType) -> str:
    """The filter type of an Arrow type: "string", "number", "boolean", or "json" for anything else."""
    if pa.types.is_dictionary(arrow_type):
        return column_type(arrow_type.value_type)
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or \
            pa.types.is_string_view(arrow_type):
        return "string"
    if pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type):
        return "number"
    return "boolean" if pa.types.is_boolean(arrow_type) else "json"


def column_types(table: pa.Table) -> dict[str, str]:
    """Column name -> filter type, for ``check_filter``."""
    return {f.name: column_type(f.type) for f in table.schema}


def describe_columns(table: pa.Table, max_values: int = 50) -> dict[str, dict]:
    """Per column ``{"type": ...}``, plus ``"values"`` (sorted) for a string column of few distinct values."""
    out = {}
    for name, type_name in column_types(table).items():
        out[name] = {"type": type_name}
        if type_name == "string":
            values = _distinct_strings(table.column(name))
            if len(values) <= max_values:
                out[name]["values"] = values.to_pylist()
    return out


def _distinct_strings(column: pa.ChunkedArray) -> pa.Array:
    distinct = pc.unique(column)
    if pa.types.is_dictionary(distinct.type):
        distinct = distinct.dictionary_decode()
    distinct = pc.drop_null(distinct)
    return distinct.take(pc.sort_indices(distinct))


def metadata_columns(json_strings: pa.Array | pa.ChunkedArray) -> pa.Table:
    """Typed columns from one JSON object per row (null or "" is no metadata); N rows in, N out."""
    lines = _object_lines(json_strings)
    table = _read_with_arrow(lines)
    if table is None or any(pa.types.is_nested(t) for t in table.schema.types):
        table = _read_with_python(lines.to_pylist())
    return table.drop_columns([f.name for f in table.schema if pa.types.is_null(f.type)])


def _object_lines(json_strings: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One line of JSON per row: newlines (JSON whitespace) as spaces, "{}" for null or blank rows."""
    text = pc.cast(json_strings, pa.large_string())
    if isinstance(text, pa.ChunkedArray):
        text = text.combine_chunks()
    text = pc.utf8_trim_whitespace(pc.replace_substring_regex(text, r"[\r\n]", " "))
    blank = pc.fill_null(pc.equal(text, ""), True)
    return pc.if_else(blank, pa.scalar("{}", pa.large_string()), text)


def _newline_joined(lines: pa.Array) -> pa.Buffer:
    """The lines as one buffer, each ending in a newline (no copy through Python)."""
    ended = pc.binary_join_element_wise(lines, pa.scalar("", pa.large_string()),
                                        pa.scalar("\n", pa.large_string()))  # line + "\n" + ""
    offsets = np.frombuffer(ended.buffers()[1], dtype=np.int64)[ended.offset:ended.offset + len(ended) + 1]
    return ended.buffers()[2].slice(int(offsets[0]), int(offsets[-1] - offsets[0]))


def _read_with_arrow(lines: pa.Array) -> pa.Table | None:
    """The rows typed by Arrow's JSON reader; None when it cannot (mixed kinds, invalid rows)."""
    if len(lines) == 0:
        return None
    data = _newline_joined(lines)
    table = _arrow_json(data)
    if table is None or table.num_rows != len(lines):  # a row of two objects reads as two rows
        return None
    guessed = [f.name for f in table.schema if pa.types.is_temporal(f.type)]  # ISO dates: keep strings
    if guessed:
        retyped = _arrow_json(data, pa.schema([(name, pa.string()) for name in guessed]))
        table = None if retyped is None else retyped.select(table.column_names)  # explicit ones came first
    return table


def _arrow_json(data: pa.Buffer, schema: pa.Schema | None = None) -> pa.Table | None:
    try:
        return pa_json.read_json(pa.BufferReader(data),
                                 parse_options=pa_json.ParseOptions(explicit_schema=schema))
    except pa.ArrowInvalid:
        return None


def _read_with_python(texts: list[str]) -> pa.Table:
    """The rows typed by Python's json module (the fallback; see the module docstring)."""
    rows = [_json_object(text, row) for row, text in enumerate(texts)]
    names = dict.fromkeys(name for row in rows for name in row)  # first-appearance order, as Arrow's
    table = pa.table({"rows": pa.nulls(len(rows))}).drop_columns(["rows"])  # keeps the row count
    for name in names:
        table = table.append_column(name, _python_column([row.get(name) for row in rows]))
    return table


def _json_object(text: str, row: int) -> dict:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise MetadataError(f"metadata row {row} is not valid JSON ({e}): {_shown(text)}; each row must be "
                            'a JSON object such as {"color": "red"}, or null/empty') from None
    if not isinstance(value, dict):
        raise MetadataError(f"metadata row {row} is a JSON {type(value).__name__}, not an object: "
                            f'{_shown(text)}; write an object such as {{"color": "red"}}')
    return value


def _python_column(values: list) -> pa.Array:
    """One column's values (None where missing) as Arrow, typed by the rules of the module docstring."""
    kinds = {_json_kind(v) for v in values if v is not None}
    if not kinds:
        return pa.nulls(len(values))
    if kinds & {"object", "array"}:
        texts = [None if v is None else _json_text(v) for v in values]
        return pa.ExtensionArray.from_storage(JSON_TYPE, pa.array(texts, pa.string()))
    if kinds == {"int"}:
        try:
            return pa.array(values, pa.int64())
        except (OverflowError, pa.ArrowInvalid):  # beyond int64: float64, as Arrow's reader does
            return pa.array(values, pa.float64())
    if kinds <= {"int", "float"}:
        return pa.array(values, pa.float64())
    if kinds == {"boolean"}:
        return pa.array(values, pa.bool_())
    return pa.array([v if v is None or isinstance(v, str) else _json_text(v) for v in values], pa.string())


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    return {int: "int", float: "float", str: "string", dict: "object", list: "array"}[type(value)]


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
