"""Evaluating a parsed filter on Arrow columns, and the filter type of an Arrow column.

``evaluate`` gives the rows of a table a filter matches, as numpy bools. Missing values (a row without
the key, or with null) match no comparison, and ``not`` negates the two-valued result (see
``puma.index.filters``). A column that the table lacks, or holds with a type other than the filter
value's (another shard), counts as missing: evaluation never raises there. Dictionary-encoded columns
are compared once per distinct value.

Types (``column_type``): "string", "number" (any integer or float column), "boolean", and "json" for
anything else (nested objects or lists, or an Arrow type filters cannot compare).
"""

from __future__ import annotations

import functools

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from puma.index.filter_tree import And, Condition, Filter, Joined, Not, value_kind

_COMPARE = {"eq": pc.equal, "ne": pc.not_equal, "gt": pc.greater, "gte": pc.greater_equal,
            "lt": pc.less, "lte": pc.less_equal}
_NUMPY_COMPARE = {"eq": np.equal, "ne": np.not_equal, "gt": np.greater, "gte": np.greater_equal,
                  "lt": np.less, "lte": np.less_equal}
_INT64 = (-2 ** 63, 2 ** 63)


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
    numeric = _numeric_rows(c, values)
    if numeric is not None:
        return numeric
    return _true_rows(_compared(c, values))


def _numeric_rows(c: Condition, values: pa.Array) -> np.ndarray | None:
    """A comparison of a signed-integer or float column with a number, in numpy on the column's own
    buffer (a third of the time of Arrow's kernel and the unpacking of its result bitmap); missing
    values match nothing, as in Arrow. None where Arrow decides: other types, 'in', 'exists', a value
    beyond int64."""
    kind = values.type
    value = c.value
    if c.op not in _NUMPY_COMPARE or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not (pa.types.is_signed_integer(kind) or pa.types.is_float32(kind) or pa.types.is_float64(kind)):
        return None
    if isinstance(value, int) and not _INT64[0] <= value < _INT64[1]:
        return None
    validity, data = values.buffers()
    numbers = np.frombuffer(data, dtype=kind.to_pandas_dtype(), count=values.offset + len(values))
    rows = _NUMPY_COMPARE[c.op](numbers[values.offset:], value)
    if values.null_count:
        rows &= _bits(validity, values.offset, len(values))
    return rows


def _present_rows(values: pa.Array) -> np.ndarray:
    """Rows holding a value (a null code, or a code of a null dictionary entry, holds none)."""
    if pa.types.is_dictionary(values.type):
        return _true_rows(pc.take(pa.array(_present_rows(values.dictionary)), values.indices))
    return _true_rows(pc.is_valid(values))


def _compared(c: Condition, values: pa.Array) -> pa.Array:
    """``values op c.value`` as booleans (null where a value is missing); ``op`` is not exists."""
    if column_type(values.type) != value_kind(c.value):
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
