"""Catalogue table cells as Arrow columns: the reserved columns as text, every other column as one
JSON object per row, and image URIs resolved against the table's folder (see puma.data.tables).

A metadata cell is written by Arrow where that gives exactly the text ``json.dumps`` gives (printable
ASCII strings, integers, booleans, nulls, floats in the range Python writes without an exponent) and by
``json.dumps`` otherwise; text that needs a Python rule is computed once per distinct value.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import posixpath
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from puma import storage
from puma.data.columns import scatter_rows, take_rows

RESERVED_COLUMNS = ("item_id", "image_uri", "label", "dataset")  # every other column is metadata


@dataclass
class Cells:
    """A table's rows reduced to what the item rows keep: the reserved columns as stripped text ('' when
    missing) and the other columns as one JSON object per row; all string arrays of the table's length."""

    ids: pa.Array
    images: pa.Array  # as written (resolved later)
    datasets: pa.Array
    labels: pa.Array
    metadata: pa.Array
    versions: pa.Array | None = None  # the stamp column's text, when one is named


def batch_cells(names: list[str], columns: Sequence[pa.Array], stamp_column: str = "") -> Cells:
    """One batch of columns (in ``names`` order) reduced to its cells."""
    by_name = dict(zip(names, columns, strict=True))
    n = len(columns[0]) if columns else 0
    blank = pa.nulls(n, pa.string())

    def text(name: str) -> pa.Array:
        return text_column(by_name.get(name, blank))

    meta = sorted(n for n in names if n not in RESERVED_COLUMNS)
    versions = text(stamp_column) if stamp_column else None
    return Cells(text("item_id"), text("image_uri"), text("dataset"), text("label"),
                 _metadata(meta, [by_name[m] for m in meta], n), versions)


def text_column(values: pa.Array) -> pa.Array:
    """Each cell as stripped text ('' for null or NaN; an integral float without '.0'), as ``cell_text``."""
    kind = values.type
    if pa.types.is_dictionary(kind):
        return text_column(values.dictionary_decode())
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        out = pc.utf8_trim_whitespace(values)  # the characters str.strip() removes (every one, tested)
    elif pa.types.is_integer(kind):
        out = pc.cast(values, pa.string())
    else:
        return _per_value(values, cell_text)
    return _filled(out, "").cast(pa.string())


def _filled(values: pa.Array, value: str) -> pa.Array:
    """``values`` with nulls replaced by ``value``."""
    return pc.fill_null(values, value) if values.null_count else values


def _per_value(values: pa.Array, fn: Callable[[object], str]) -> pa.Array:
    """``fn`` of each cell as a string array, called once per distinct value where Arrow can hash them."""
    try:
        distinct = pc.unique(values)
    except pa.ArrowNotImplementedError:  # lists, structs, ...: once per cell
        return pa.array([fn(v) for v in values.to_pylist()], pa.string())
    mapped = pa.array([fn(v) for v in distinct.to_pylist()], pa.string())
    return mapped.take(pc.index_in(values, value_set=distinct))


def cell_text(value) -> str:
    """A cell as stripped text: '' for null or NaN; an integral float without '.0' (pandas' gaps)."""
    if value is None:
        return ""
    if isinstance(value, float):
        if not math.isfinite(value):
            return ""
        if value.is_integer():
            return str(int(value))
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace").strip()
    return str(value).strip()


def _metadata(names: list[str], columns: list[pa.Array], n: int) -> pa.Array:
    """Each row's metadata columns (``names`` sorted) as one JSON object: '{"a": 1, "b": "x"}'."""
    if not names:
        return pa.repeat(pa.scalar("{}"), n)
    parts: list = []
    for i, (name, values) in enumerate(zip(names, columns, strict=True)):
        parts += [("{" if i == 0 else ", ") + json.dumps(name) + ": ", json_column(values)]
    return pc.binary_join_element_wise(*parts, "}", "")


def json_column(values: pa.Array) -> pa.Array:
    """Each cell as ``json.dumps(json_safe(cell), sort_keys=True, allow_nan=False)`` writes it."""
    kind = values.type
    if pa.types.is_dictionary(kind):
        return json_column(values.dictionary_decode())
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        out = _json_strings(values.cast(pa.string()))
    elif pa.types.is_integer(kind):
        out = pc.cast(values, pa.string())
    elif pa.types.is_boolean(kind):
        out = pc.if_else(values, "true", "false")
    elif pa.types.is_floating(kind):
        out = _json_floats(values.cast(pa.float64()))
    else:
        return _per_cell(values, np.ones(len(values), bool))
    return _filled(out, "null")


def _json_strings(values: pa.Array) -> pa.Array:
    """Strings as JSON: printable ASCII by Arrow (quotes and backslashes escaped), the rest by json.dumps."""
    printable = pc.ascii_is_printable(values).fill_null(True).to_numpy(zero_copy_only=False)
    escaped = values
    for char in ("\\", '"'):  # the backslash first: the quotes' escapes are not escaped again
        if pc.any(pc.match_substring(escaped, char)).as_py():
            escaped = pc.replace_substring(escaped, char, "\\" + char)
    out = pc.binary_join_element_wise('"', escaped, '"', "")
    return _patched(out, values, ~printable)


def _json_floats(values: pa.Array) -> pa.Array:
    """Floats as Python writes them (repr; non-finite as null): Arrow's text where it is the same (no
    exponent, 1e-4 <= |x| < 1e16 or 0, '.0' added to integral ones), json.dumps for the others."""
    text = pc.cast(values, pa.string())
    size = pc.abs(values)
    plain = pc.and_(pc.or_(pc.equal(values, 0), pc.and_(pc.greater_equal(size, 1e-4), pc.less(size, 1e16))),
                    pc.invert(pc.match_substring(text, "e")))
    plain = plain.fill_null(True).to_numpy(zero_copy_only=False)  # nulls: 'null' below
    integral = pc.invert(pc.match_substring(text, "."))
    out = pc.if_else(integral, pc.binary_join_element_wise(text, ".0", ""), text)
    return _patched(out, values, ~plain)


def _patched(out: pa.Array, values: pa.Array, other: np.ndarray) -> pa.Array:
    """``out`` with the cells where ``other`` is True written by json.dumps instead."""
    if not other.any():
        return out
    return scatter_rows(out, np.flatnonzero(other), _per_cell(values, other))


def _per_cell(values: pa.Array, chosen: np.ndarray) -> pa.Array:
    """json.dumps of the chosen cells (in order)."""
    picked = values.filter(pa.array(chosen)).to_pylist()
    return pa.array([json.dumps(json_safe(v), sort_keys=True, allow_nan=False) for v in picked], pa.string())


def json_safe(value):
    """A value JSON can hold exactly: numbers, text, bools, null (NaN too); lists and objects of them."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return str(value)  # Decimal, timedelta, ...


# ----------------------------------------------------------------------------- image URIs


def resolve_image_uri(value: str, folder: str) -> str:
    """An absolute local path or s3:// URI; a relative ``value`` is joined to ``folder`` (the table's)."""
    if storage.is_s3(value):
        return value
    value = os.path.expanduser(value.removeprefix("file://"))
    if os.path.isabs(value):
        return os.path.normpath(value)
    if storage.is_s3(folder):
        return "s3://" + posixpath.normpath(posixpath.join(folder.removeprefix("s3://"), value))
    return os.path.normpath(storage.join(folder, value))


def resolve_image_uris(values: pa.Array, folder: str) -> pa.Array:
    """``resolve_image_uri`` of every value ('' stays ''): s3:// URIs and clean paths (no '.', '..' or
    empty segment) by Arrow, the others once per distinct value."""
    s3 = pc.starts_with(values, "s3://")
    clean = pc.invert(_any_of(pc.match_substring(values, "//"), pc.match_substring(values, "/."),
                              pc.starts_with(values, "."), pc.ends_with(values, "/"),
                              pc.starts_with(values, "~"), pc.starts_with(values, "file://")))
    absolute = pc.and_(clean, pc.starts_with(values, "/"))
    relative = pc.and_(clean, pc.invert(pc.or_(pc.starts_with(values, "/"), pc.equal(values, ""))))
    prefix = resolve_image_uri("x", folder)[:-1]  # the folder, normalised, with its separator
    out = pc.if_else(relative, pc.binary_join_element_wise(prefix, values, ""), values) \
        if pc.any(relative).as_py() else values
    simple = pc.or_(pc.or_(s3, relative), pc.or_(absolute, pc.equal(values, "")))
    other = pc.invert(simple).to_numpy(zero_copy_only=False)
    if not other.any():
        return out
    where = np.flatnonzero(other)
    fixed = _per_value(take_rows(values, where), lambda v: resolve_image_uri(v, folder))
    return scatter_rows(out, where, fixed)


def _any_of(*masks: pa.Array) -> pa.Array:
    out = masks[0]
    for mask in masks[1:]:
        out = pc.or_(out, mask)
    return out
