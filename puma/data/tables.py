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
"""

from __future__ import annotations

import datetime
import io
import json
import math
import os
import posixpath
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from puma import storage
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


class TableError(UserError, ValueError):
    """A catalogue table cannot be read: not parsable, or a required column is missing."""


@dataclass
class ItemTable:
    """A table's valid rows (``ROWS_SCHEMA``), a reject dict per other row, and its metadata columns."""

    rows: pa.Table
    rejects: list[dict] = field(default_factory=list)
    metadata_columns: list[str] = field(default_factory=list)
    uri: str = ""


@dataclass
class _Raw:
    """A parsed table before any check: each column's values, and each row's place in the file."""

    columns: dict[str, list]
    lines: list[int]


def is_table(uri: str) -> bool:
    """Whether ``uri`` names a catalogue table (by suffix, any case)."""
    return str(uri).lower().endswith(TABLE_SUFFIXES)


def table_stem(uri: str) -> str:
    """The file name without its table suffix: ``shop`` for ``s3://bucket/shop.csv``."""
    name = str(uri).rstrip("/").rsplit("/", 1)[-1]
    suffix = next((s for s in TABLE_SUFFIXES if name.lower().endswith(s)), "")
    return name[:len(name) - len(suffix)]


def read_item_table(uri: str, dataset: str = "") -> ItemTable:
    """The valid rows of the table at ``uri`` and a reject for every other row (module docstring)."""
    uri = storage.absolute(uri)  # messages name the file wherever the job runs
    raw = _parse(uri)
    metadata_columns = [c for c in raw.columns if c not in RESERVED_COLUMNS]
    if not raw.columns and not raw.lines:  # a JSONL file without records: nothing to check
        return ItemTable(ROWS_SCHEMA.empty_table(), [], [], uri)
    _check_columns(uri, list(raw.columns))
    ids = [_text(v) for v in raw.columns["item_id"]]
    datasets = _datasets(raw, dataset or table_stem(uri))
    folder = _folder(uri)
    images = [resolve_image_uri(t, folder) if t else "" for t in map(_text, raw.columns["image_uri"])]
    keep, rejects = _screen(uri, raw.lines, ids, images, datasets)
    labels, class_names = _labels([raw.columns.get("label", [None] * len(ids))[i] for i in keep],
                                  [datasets[i] for i in keep])
    rows = pa.table({
        "item_id": [ids[i] for i in keep], "image_uri": [images[i] for i in keep], "label": labels,
        "class_name": class_names, "dataset": [datasets[i] for i in keep],
        "metadata": [_metadata(raw, metadata_columns, i) for i in keep],
        "source_row": [raw.lines[i] for i in keep]}, schema=ROWS_SCHEMA)
    return ItemTable(rows, rejects, metadata_columns, uri)


# ----------------------------------------------------------------------------- parsing


def _parse(uri: str) -> _Raw:
    """Read and parse the table by its suffix."""
    suffix = next((s for s in TABLE_SUFFIXES if str(uri).lower().endswith(s)), None)
    if suffix is None:
        raise TableError(f"{uri} is not a catalogue table: its name must end in one of "
                         f"{list(TABLE_SUFFIXES)}")
    return _PARSERS[suffix](storage.read_bytes(uri), uri)


def _parse_csv(data: bytes, uri: str) -> _Raw:
    """Every cell as text (an empty cell: None); the header is row 1, so data row i is row i + 2."""
    import pyarrow.csv as pacsv

    try:
        names = pacsv.open_csv(io.BytesIO(data)).schema.names
        options = pacsv.ConvertOptions(column_types={n: pa.string() for n in names}, strings_can_be_null=True,
                                       null_values=[""], quoted_strings_can_be_null=False)
        table = pacsv.read_csv(io.BytesIO(data), convert_options=options)
    except pa.ArrowInvalid as exc:
        raise TableError(f"{uri} is not a readable CSV table ({one_line(exc)}); expected a header line with "
                         f"item_id and image_uri, then one line per item with as many fields") from exc
    columns = [(name.strip(), table.column(i).to_pylist()) for i, name in enumerate(table.column_names)]
    return _raw(uri, columns, list(range(2, table.num_rows + 2)))


def _parse_jsonl(data: bytes, uri: str) -> _Raw:
    """One JSON object per line (blank lines skipped); a key missing from a record is None there."""
    records, lines = [], []
    for number, line in enumerate(_decode(data, uri).split("\n"), 1):
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
    return _raw(uri, [(n, [r.get(n) for r in records]) for n in names], lines)


def _parse_parquet(data: bytes, uri: str) -> _Raw:
    """Values as Python objects; row i is row i + 1."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowInvalid, OSError) as exc:
        raise TableError(f"{uri} is not a readable Parquet table ({one_line(exc)})") from exc
    columns = [(name, table.column(i).to_pylist()) for i, name in enumerate(table.column_names)]
    return _raw(uri, columns, list(range(1, table.num_rows + 1)))


_PARSERS: dict[str, Callable[[bytes, str], _Raw]] = {
    ".csv": _parse_csv, ".jsonl": _parse_jsonl, ".parquet": _parse_parquet}


def _decode(data: bytes, uri: str) -> str:
    """UTF-8 text (a byte-order mark dropped)."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TableError(f"{uri} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                         "save it as UTF-8") from exc


def _raw(uri: str, columns: Sequence[tuple[str, list]], lines: list[int]) -> _Raw:
    """Columns by name; a name given twice is an error."""
    names = [name for name, _ in columns]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise TableError(f"{uri} has columns {repeated} more than once; give every column its own name")
    return _Raw(dict(columns), lines)


def _check_columns(uri: str, names: list[str]) -> None:
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise TableError(f"{uri} has no {' or '.join(missing)} column; it has {names}. A catalogue table "
                         f"needs {list(REQUIRED_COLUMNS)} (label, dataset and any other columns optional)")


# ----------------------------------------------------------------------------- values


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


def _folder(uri: str) -> str:
    """The folder holding the table: relative image_uri values start there."""
    return posixpath.dirname(uri) if storage.is_s3(uri) else os.path.dirname(storage.absolute(uri))


def _datasets(raw: _Raw, default: str) -> list[str]:
    """Each row's dataset: its own value, else ``default``."""
    values = raw.columns.get("dataset", [None] * len(raw.lines))
    return [_text(v) or default for v in values]


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


def _metadata(raw: _Raw, names: list[str], row: int) -> str:
    """The row's metadata columns as a JSON object, keys sorted."""
    return json.dumps({n: _json_safe(raw.columns[n][row]) for n in names}, sort_keys=True, allow_nan=False)


# ----------------------------------------------------------------------------- rows and labels


def _screen(uri: str, lines: list[int], ids: list[str], images: list[str], datasets: list[str]
            ) -> tuple[list[int], list[dict]]:
    """Indices of the rows kept, and a reject for every other: empty id, no image, repeated id."""
    problems: dict[int, tuple[str, str]] = {}
    for i, (item_id, image) in enumerate(zip(ids, images, strict=True)):
        if not item_id:
            problems[i] = ("empty_item_id", "item_id is empty")
        elif not image:
            problems[i] = ("missing_image_uri", f"image_uri of item {item_id!r} is empty")
    rows_of: dict[str, list[int]] = defaultdict(list)
    for i, item_id in enumerate(ids):
        if i not in problems:
            rows_of[item_id].append(i)
    for item_id, rows in rows_of.items():
        numbers = ", ".join(str(lines[i]) for i in rows)
        for i in rows[1:]:
            problems[i] = ("duplicate_item_id", f"item_id {item_id!r} is on rows {numbers}; the first "
                                                f"(row {lines[rows[0]]}) is kept")
    rejects = [Reject(ids[i] or f"<row {lines[i]}>", datasets[i], reason, REJECT_STAGE, images[i],
                      detail=f"{uri} row {lines[i]}: {detail}").to_dict()
               for i, (reason, detail) in sorted(problems.items())]
    return [i for i in range(len(ids)) if i not in problems], rejects


def _label_parts(value) -> tuple[str, int | None]:
    """A label cell as (text, its integer or None): '' when empty; 3, 3.0 and '3' are all 3."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value), value
    text = _text(value)
    return text, (int(text) if _INTEGER.fullmatch(text) else None)


def _labels(values: list, datasets: list[str]) -> tuple[list[int], list[str]]:
    """(label, class_name) per row: integers as given, text numbered by sorted order per dataset."""
    parts = [_label_parts(v) for v in values]
    labels, class_names = [NO_LABEL] * len(values), [""] * len(values)
    rows_of: dict[str, list[int]] = defaultdict(list)
    for i, ((text, _), name) in enumerate(zip(parts, datasets, strict=True)):
        if text:
            rows_of[name].append(i)
    for rows in rows_of.values():
        if all(parts[i][1] is not None for i in rows):
            for i in rows:
                labels[i] = parts[i][1]
            continue
        index = {text: k for k, text in enumerate(sorted({parts[i][0] for i in rows}))}
        for i in rows:
            labels[i], class_names[i] = index[parts[i][0]], parts[i][0]
    return labels, class_names
