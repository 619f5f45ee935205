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

This module owns the rows: which are kept, their labels and class names. Parsing a file is
puma.data.table_parsing, the cells (text, JSON metadata, image URIs) puma.data.table_cells; their
public names are importable from here too.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections import defaultdict
from dataclasses import dataclass, field, fields

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from puma import storage
from puma.data.columns import repeated_rows, take_rows
from puma.data.rejects import Reject
from puma.data.table_cells import (  # noqa: F401 - re-exported: their home before the split
    RESERVED_COLUMNS,
    Cells,
    json_column,
    resolve_image_uri,
    resolve_image_uris,
    text_column,
)
from puma.data.table_parsing import (  # noqa: F401 - re-exported: their home before the split
    CHUNK_BYTES,
    CSV_BLOCK_BYTES,
    REQUIRED_COLUMNS,
    TABLE_SUFFIXES,
    TableError,
    parse_table,
)

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


@dataclass
class ItemTable:
    """A table's valid rows (``ROWS_SCHEMA``), a reject dict per other row, and its metadata columns."""

    rows: pa.Table
    rejects: list[dict] = field(default_factory=list)
    metadata_columns: list[str] = field(default_factory=list)
    uri: str = ""
    versions: pa.Array | None = None  # the ``stamp_column``'s text per row ('' when empty), when asked for


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
    raw = parse_table(uri, stamp_column)
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


def _keep_rows(cells: Cells, keep: np.ndarray) -> None:
    """Only the rows ``keep`` of every column, one column at a time (each old one released before the next
    is filtered, chunk by chunk: a table's rows are held about once, not twice)."""
    mask = np.zeros(len(cells.ids), bool)
    mask[keep] = True
    chosen = pa.array(mask)
    for f in fields(Cells):
        if getattr(cells, f.name) is not None:
            setattr(cells, f.name, getattr(cells, f.name).filter(chosen))


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
