"""Catalogue tables: one row per item in a CSV, JSONL or Parquet file, for embedding and for prepare.

A table names each item and where its image is; a label, a dataset and any other columns are
optional::

    item_id,image_uri,label,price
    sku-1,photos/sku-1.jpg,boot,40
    sku-2,s3://bucket/photos/sku-2.jpg,sandal,12.5

``read_item_table`` reads one (a local path or s3:// URI) into ``ItemTable.rows`` (``ROWS_SCHEMA``):

- ``item_id`` as given; ``image_uri`` an absolute local path or s3:// URI (a relative value is
  resolved against the table's folder, local or s3://).
- ``label``: integer labels (or text that is all integers) stay as they are, ``class_name`` "";
  text labels are numbered by their sorted order within each dataset, ``class_name`` the text.
  ``NO_LABEL`` (-1) where a row has none.
- ``dataset``: the row's own ``dataset`` value, else the ``dataset`` argument, else the table
  file's stem (``shop`` for ``shop.csv``).
- ``metadata``: every other column of the row as one JSON object, keys sorted (``{}`` if none).
- ``source_row``: where the row is in the file, named by every message about it. CSV: the header
  is row 1 and the first item row 2 (its line, when no line is blank and no value spans lines);
  JSONL: its line; Parquet: its row, from 1.

Rows that cannot be items are not errors: they leave ``rows`` for ``rejects`` (stage ``catalogue``,
reasons ``empty_item_id``, ``missing_image_uri``, ``duplicate_item_id``; see puma.data.rejects),
and the first row of a repeated item_id is kept. Whether an image exists or decodes is not checked
here: the stage that reads the bytes finds that. A table that cannot be parsed or lacks the
``item_id`` or ``image_uri`` column raises ``TableError``.

CSV cells are read as text, so ``007`` stays ``007``; an empty cell counts as missing. JSONL and
Parquet values keep their types in the metadata (NaN becomes null; dates and other types text).

CSV and Parquet tables are read as a stream of record batches and reduced column by column with Arrow
compute (no Python object per row): a metadata cell is written by Arrow where that gives exactly the
text ``json.dumps`` gives (printable ASCII strings, integers, booleans, nulls, floats in the range
Python writes without an exponent) and by ``json.dumps`` otherwise, so the JSON is the same byte for
byte as one ``json.dumps(..., sort_keys=True)`` per row (an index compares it with the JSON it stored).
Text that needs a Python rule (a relative image path with ``..``, a float item id) is computed once
per distinct value. JSONL records are parsed one by one (``json.loads``) and then reduced the same way.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import posixpath
import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from puma import storage
from puma.data.columns import repeated_rows, scatter_rows, take_rows
from puma.data.rejects import Reject
from puma.errors import UserError, one_line

TABLE_SUFFIXES = (".csv", ".jsonl", ".parquet")
REQUIRED_COLUMNS = ("item_id", "image_uri")
RESERVED_COLUMNS = ("item_id", "image_uri", "label", "dataset")  # every other column is metadata
NO_LABEL = -1
REJECT_STAGE = "catalogue"
ROWS_SCHEMA = pa.schema([
    pa.field("item_id", pa.string(), nullable=False),
    pa.field("image_uri", pa.string(), nullable=False),
    pa.field("label", pa.int64(), nullable=False),
    pa.field("class_name", pa.string(), nullable=False),
    pa.field("dataset", pa.string(), nullable=False),
    pa.field("metadata", pa.string(), nullable=False),
    pa.field("source_row", pa.int64(), nullable=False),
])
_INTEGER = re.compile(r"[+-]?\d+")
CSV_BLOCK_BYTES = 8 << 20  # CSV text parsed per record batch
CHUNK_BYTES = 64 << 20  # a parsed column's bytes per chunk


class TableError(UserError, ValueError):
    """A catalogue table cannot be read: not parsable, or a required column is missing."""


@dataclass
class ItemTable:
    """A table's valid rows (``ROWS_SCHEMA``), a reject dict per other row, and its metadata columns."""

    rows: pa.Table
    rejects: list[dict] = field(default_factory=list)
    metadata_columns: list[str] = field(default_factory=list)
    uri: str = ""
    versions: pa.Array | None = None  # the ``stamp_column``'s text per row ('' when empty), when asked for


@dataclass
class _Cells:
    """A table's rows reduced to what the item rows keep: the reserved columns as stripped text ('' when
    missing) and the other columns as one JSON object per row; all string arrays of the table's length."""

    ids: pa.Array
    images: pa.Array  # as written (resolved later)
    datasets: pa.Array
    labels: pa.Array
    metadata: pa.Array
    versions: pa.Array | None = None  # the stamp column's text, when one is named


@dataclass
class _Raw:
    """A parsed table: its column names, its rows reduced (None for a JSONL file without records), and
    each row's place in the file."""

    names: list[str]
    cells: _Cells | None
    lines: np.ndarray  # (N,) int64


def is_table(uri: str) -> bool:
    """Whether ``uri`` names a catalogue table (by suffix, any case)."""
    return str(uri).lower().endswith(TABLE_SUFFIXES)


def table_stem(uri: str) -> str:
    """The file name without its table suffix: ``shop`` for ``s3://bucket/shop.csv``."""
    name = str(uri).rstrip("/").rsplit("/", 1)[-1]
    suffix = next((s for s in TABLE_SUFFIXES if name.lower().endswith(s)), "")
    return name[:len(name) - len(suffix)]


def read_item_table(uri: str, dataset: str = "", stamp_column: str = "") -> ItemTable:
    """The valid rows of the table at ``uri`` and a reject for every other row (module docstring);
    ``stamp_column``: a column whose text (a version, an ETag) is also kept per row as ``versions``."""
    uri = storage.absolute(uri)  # messages name the file wherever the job runs
    raw = _parse(uri, stamp_column)
    metadata_columns = [c for c in raw.names if c not in RESERVED_COLUMNS]
    if raw.cells is None:  # a JSONL file without records: nothing to check
        return ItemTable(ROWS_SCHEMA.empty_table(), [], [], uri, pa.array([], pa.string()))
    if stamp_column and stamp_column not in raw.names:
        raise TableError(f"{uri} has no column {stamp_column!r} (embed.stamp_column); it has {raw.names}")
    cells = raw.cells
    cells.datasets = pc.if_else(pc.equal(cells.datasets, ""), dataset or table_stem(uri), cells.datasets)
    cells.images = resolve_image_uris(cells.images, _folder(uri))
    keep, rejects = _screen(uri, raw.lines, cells.ids, cells.images, cells.datasets)
    if len(keep) < len(raw.lines):
        _keep_rows(cells, keep)
    labels, class_names = _labels(_one(cells.labels), _one(cells.datasets))
    rows = pa.table({"item_id": cells.ids, "image_uri": cells.images, "label": labels,
                     "class_name": class_names, "dataset": cells.datasets, "metadata": cells.metadata,
                     "source_row": raw.lines[keep]}, schema=ROWS_SCHEMA)
    return ItemTable(rows, rejects, metadata_columns, uri, cells.versions)


def _one(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A (small) column as one array."""
    return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values


def _keep_rows(cells: _Cells, keep: np.ndarray) -> None:
    """Only the rows ``keep`` of every column, one column at a time (each old one released before the next
    is filtered, chunk by chunk: a table's rows are held about once, not twice)."""
    mask = np.zeros(len(cells.ids), bool)
    mask[keep] = True
    chosen = pa.array(mask)
    for f in fields(_Cells):
        if getattr(cells, f.name) is not None:
            setattr(cells, f.name, getattr(cells, f.name).filter(chosen))


# ----------------------------------------------------------------------------- parsing


def _parse(uri: str, stamp_column: str = "") -> _Raw:
    """Read and parse the table by its suffix."""
    suffix = next((s for s in TABLE_SUFFIXES if str(uri).lower().endswith(s)), None)
    if suffix is None:
        raise TableError(f"{uri} is not a catalogue table: its name must end in one of "
                         f"{list(TABLE_SUFFIXES)}")
    return _PARSERS[suffix](uri, stamp_column)


def _parse_csv(uri: str, stamp_column: str) -> _Raw:
    """Every cell as text (an empty cell: None); the header is row 1, so data row i is row i + 2."""
    import pyarrow.csv as pacsv

    read = pacsv.ReadOptions(block_size=CSV_BLOCK_BYTES)
    try:
        with storage.open_stream(uri) as f:
            header = pacsv.open_csv(f, read_options=read).schema.names
        names = _unique_names(uri, [n.strip() for n in header])
        options = pacsv.ConvertOptions(column_types={n: pa.string() for n in header},
                                       strings_can_be_null=True, null_values=[""],
                                       quoted_strings_can_be_null=False)
        with storage.open_stream(uri) as f:
            reader = pacsv.open_csv(f, read_options=read, convert_options=options)
            cells = [_cells(names, batch.columns, stamp_column) for batch in _batches(reader)]
    except pa.ArrowInvalid as exc:
        raise TableError(f"{uri} is not a readable CSV table ({one_line(exc)}); expected a header line with "
                         f"item_id and image_uri, then one line per item with as many fields") from exc
    return _raw(uri, names, cells, 2)


def _batches(reader) -> Iterator[pa.RecordBatch]:
    """The reader's record batches (a stream of them: one in memory at a time)."""
    while True:
        try:
            yield reader.read_next_batch()
        except StopIteration:
            return


def _parse_jsonl(uri: str, stamp_column: str) -> _Raw:
    """One JSON object per line (blank lines skipped); a key missing from a record is None there."""
    records, lines = [], []
    for number, line in enumerate(_decode(storage.read_bytes(uri), uri).split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TableError(f"{uri} line {number} is not JSON ({exc.msg}); a JSONL table has one JSON "
                             "object per line") from exc
        if not isinstance(record, dict):
            raise TableError(f"{uri} line {number} is a JSON {type(record).__name__}, not an object; a JSONL "
                             "table has one object per line, e.g. {\"item_id\": ..., \"image_uri\": ...}")
        records.append(record)
        lines.append(number)
    names = list(dict.fromkeys(key for record in records for key in record))
    if not records:
        return _Raw(names, None, np.zeros(0, np.int64))
    _check_columns(uri, names)
    meta = [n for n in names if n not in RESERVED_COLUMNS]

    def text(name: str) -> pa.Array:
        return pa.array([_text(r.get(name)) for r in records], pa.string())

    metadata = pa.array([json.dumps({n: _json_safe(r.get(n)) for n in meta}, sort_keys=True, allow_nan=False)
                         for r in records], pa.string())
    cells = _Cells(text("item_id"), text("image_uri"), text("dataset"), text("label"), metadata,
                   text(stamp_column) if stamp_column else None)
    return _Raw(names, cells, np.asarray(lines, np.int64))


def _parse_parquet(uri: str, stamp_column: str) -> _Raw:
    """Row groups one at a time, each reduced to its cells; row i is row i + 1."""
    import pyarrow.parquet as pq

    source = storage.open_file(uri)
    try:
        file = pq.ParquetFile(source)
        names = _unique_names(uri, file.schema_arrow.names)
        cells = [_cells(names, [c.combine_chunks() for c in storage.call(
            "reading", uri, lambda g=g: file.read_row_group(g)).columns], stamp_column)
                 for g in range(file.num_row_groups)]
    except (pa.ArrowInvalid, OSError) as exc:
        if isinstance(exc, storage.StorageError):
            raise
        raise TableError(f"{uri} is not a readable Parquet table ({one_line(exc)})") from exc
    finally:
        source.close()
    return _raw(uri, names, cells, 1)


_PARSERS: dict[str, Callable[[str, str], _Raw]] = {
    ".csv": _parse_csv, ".jsonl": _parse_jsonl, ".parquet": _parse_parquet}


def _decode(data: bytes, uri: str) -> str:
    """UTF-8 text (a byte-order mark dropped)."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TableError(f"{uri} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                         "save it as UTF-8") from exc


def _unique_names(uri: str, names: list[str]) -> list[str]:
    """The column names, checked: a name given twice is an error, and item_id and image_uri are needed."""
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise TableError(f"{uri} has columns {repeated} more than once; give every column its own name")
    _check_columns(uri, names)
    return names


def _raw(uri: str, names: list[str], batches: list[_Cells], first_row: int) -> _Raw:
    """The batches' cells as one table's (one array a column), rows numbered from ``first_row``."""
    parts = []
    for f in fields(_Cells):  # a column at a time
        chunks = [getattr(c, f.name) for c in batches]
        for c in batches:
            setattr(c, f.name, None)
        parts.append(None if chunks and chunks[0] is None else _joined(chunks))  # versions: none named
    cells = _Cells(*parts)
    return _Raw(names, cells, np.arange(first_row, first_row + len(cells.ids), dtype=np.int64))


def _joined(chunks: list[pa.Array]) -> pa.ChunkedArray:
    """The batches' arrays as one column in chunks of about CHUNK_BYTES (small batches concatenated, each
    released once copied: the column is held once, never twice; ``take_rows`` takes from it chunk by
    chunk)."""
    out, group, size = [], [], 0
    while chunks:
        group.append(chunks.pop(0))
        size += group[-1].nbytes
        if size >= CHUNK_BYTES or group[-1].nbytes >= CHUNK_BYTES // 64 or not chunks:
            out.append(group[0] if len(group) == 1 else pa.concat_arrays(group))
            group, size = [], 0
    return pa.chunked_array(out, pa.string())


def _check_columns(uri: str, names: list[str]) -> None:
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise TableError(f"{uri} has no {' or '.join(missing)} column; it has {names}. A catalogue table "
                         f"needs {list(REQUIRED_COLUMNS)} (label, dataset and any other columns optional)")


# ----------------------------------------------------------------------------- cells


def _cells(names: list[str], columns: Sequence[pa.Array], stamp_column: str = "") -> _Cells:
    """One batch of columns (in ``names`` order) reduced to its cells."""
    by_name = dict(zip(names, columns, strict=True))
    n = len(columns[0]) if columns else 0
    blank = pa.nulls(n, pa.string())

    def text(name: str) -> pa.Array:
        return text_column(by_name.get(name, blank))

    meta = sorted(n for n in names if n not in RESERVED_COLUMNS)
    versions = text(stamp_column) if stamp_column else None
    return _Cells(text("item_id"), text("image_uri"), text("dataset"), text("label"),
                  _metadata(meta, [by_name[m] for m in meta], n), versions)


def text_column(values: pa.Array) -> pa.Array:
    """Each cell as stripped text ('' for null or NaN; an integral float without '.0'), as ``_text``."""
    kind = values.type
    if pa.types.is_dictionary(kind):
        return text_column(values.dictionary_decode())
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        out = pc.utf8_trim_whitespace(values)  # the characters str.strip() removes (every one, tested)
    elif pa.types.is_integer(kind):
        out = pc.cast(values, pa.string())
    else:
        return _per_value(values, _text)
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


def _text(value) -> str:
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
    """Each cell as ``json.dumps(_json_safe(cell), sort_keys=True, allow_nan=False)`` writes it."""
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
    return pa.array([json.dumps(_json_safe(v), sort_keys=True, allow_nan=False) for v in picked], pa.string())


def _json_safe(value):
    """A value JSON can hold exactly: numbers, text, bools, null (NaN too); lists and objects of them."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
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


def _folder(uri: str) -> str:
    """The folder holding the table: relative image_uri values start there."""
    return posixpath.dirname(uri) if storage.is_s3(uri) else os.path.dirname(storage.absolute(uri))


# ----------------------------------------------------------------------------- rows and labels


def _screen(uri: str, lines: np.ndarray, ids: pa.Array, images: pa.Array, datasets: pa.Array
            ) -> tuple[np.ndarray, list[dict]]:
    """Indices of the rows kept, and a reject for every other: empty id, no image, repeated id."""
    no_id = pc.equal(ids, "").to_numpy(zero_copy_only=False)
    no_image = pc.equal(images, "").to_numpy(zero_copy_only=False) & ~no_id
    problems: dict[int, tuple[str, str]] = {int(i): ("empty_item_id", "item_id is empty")
                                            for i in np.flatnonzero(no_id)}
    for i in np.flatnonzero(no_image):
        problems[int(i)] = ("missing_image_uri", f"image_uri of item {ids[i].as_py()!r} is empty")
    valid = np.flatnonzero(~(no_id | no_image))
    repeated = valid[repeated_rows(take_rows(ids, valid) if len(valid) < len(ids) else ids)]
    if len(repeated):
        problems.update(_duplicates(lines, ids, repeated))
    rows = sorted(problems)
    bad = np.zeros(len(ids), bool)
    bad[rows] = True
    rejects = [Reject(ids[i].as_py() or f"<row {lines[i]}>", datasets[i].as_py(), reason, REJECT_STAGE,
                      images[i].as_py(), detail=f"{uri} row {lines[i]}: {detail}").to_dict()
               for i, (reason, detail) in ((i, problems[i]) for i in rows)]
    return np.flatnonzero(~bad), rejects


def _duplicates(lines: np.ndarray, ids: pa.Array, where: np.ndarray) -> dict[int, tuple[str, str]]:
    """A duplicate_item_id problem for every row but the first of each repeated item id (``where``: every
    row of those ids, sorted)."""
    rows_of: dict[str, list[int]] = defaultdict(list)
    for i, item_id in zip(where.tolist(), take_rows(ids, where).to_pylist(), strict=True):
        rows_of[item_id].append(i)
    problems = {}
    for item_id, rows in rows_of.items():
        numbers = ", ".join(str(lines[i]) for i in rows)
        for i in rows[1:]:
            problems[i] = ("duplicate_item_id", f"item_id {item_id!r} is on rows {numbers}; the first "
                                                f"(row {lines[rows[0]]}) is kept")
    return problems


def _labels(texts: pa.Array, datasets: pa.Array) -> tuple[pa.Array, pa.Array]:
    """(label, class_name) per row from its label text: integers as given, text numbered by sorted order
    per dataset; decided once per distinct (dataset, text) pair."""
    n = len(texts)
    labels, class_names = np.full(n, NO_LABEL, np.int64), np.zeros(n, np.int64)
    has = pc.not_equal(texts, "").to_numpy(zero_copy_only=False)
    names = [""]
    if has.any():
        ds, tx = datasets.dictionary_encode(), texts.dictionary_encode()
        key = (ds.indices.to_numpy().astype(np.int64) * len(tx.dictionary)
               + tx.indices.to_numpy().astype(np.int64))[has]
        pairs, inverse = np.unique(key, return_inverse=True)
        pair_ds = ds.dictionary.take(pa.array(pairs // len(tx.dictionary))).to_pylist()
        pair_text = tx.dictionary.take(pa.array(pairs % len(tx.dictionary))).to_pylist()
        pair_label, pair_name = _number(pair_ds, pair_text)
        names += pair_text
        labels[has] = np.asarray(pair_label, np.int64)[inverse]
        class_names[has] = np.where(np.asarray(pair_name)[inverse], 1 + inverse, 0)
    return pa.array(labels), pa.array(names, pa.string()).take(pa.array(class_names))


def _number(datasets: list[str], texts: list[str]) -> tuple[list[int], list[bool]]:
    """For distinct (dataset, label text) pairs: each one's label, and whether its text is its class name."""
    parts = [(t, int(t) if _INTEGER.fullmatch(t) else None) for t in texts]
    pairs_of: dict[str, list[int]] = defaultdict(list)
    for i, name in enumerate(datasets):
        pairs_of[name].append(i)
    labels, named = [NO_LABEL] * len(texts), [False] * len(texts)
    for pairs in pairs_of.values():
        if all(parts[i][1] is not None for i in pairs):
            for i in pairs:
                labels[i] = parts[i][1]
            continue
        index = {text: k for k, text in enumerate(sorted({parts[i][0] for i in pairs}))}
        for i in pairs:
            labels[i], named[i] = index[parts[i][0]], True
    return labels, named
