"""Item metadata (one JSON object per row) read into typed Arrow columns that filters can compare.

``metadata_columns``: Arrow's C++ JSON reader types one JSON object per row. Numbers stay
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

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from puma.errors import UserError
from puma.index.filter_tree import shown

JSON_TYPE = pa.json_(pa.string())  # the "json" columns of metadata_columns


class MetadataError(UserError, ValueError):
    """A metadata row that is not a JSON object (nor null or empty)."""


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
        raise MetadataError(f"metadata row {row} is not valid JSON ({e}): {shown(text)}; each row must be "
                            'a JSON object such as {"color": "red"}, or null/empty') from None
    if not isinstance(value, dict):
        raise MetadataError(f"metadata row {row} is a JSON {type(value).__name__}, not an object: "
                            f'{shown(text)}; write an object such as {{"color": "red"}}')
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
