"""Parsing catalogue tables (CSV, JSONL, Parquet) into their rows' cells (puma.data.table_cells).

CSV and Parquet tables are read as a stream of record batches, each reduced to its cells at once (no
Python object per row); JSONL records are parsed one by one (``json.loads``) and then reduced the same
way. A table that cannot be parsed or lacks the item_id or image_uri column raises ``TableError``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa

from puma import storage
from puma.data.table_cells import RESERVED_COLUMNS, Cells, batch_cells, cell_text, json_safe
from puma.errors import UserError, one_line

TABLE_SUFFIXES = (".csv", ".jsonl", ".parquet")
REQUIRED_COLUMNS = ("item_id", "image_uri")
CSV_BLOCK_BYTES = 8 << 20  # CSV text parsed per record batch
CHUNK_BYTES = 64 << 20  # a parsed column's bytes per chunk


class TableError(UserError, ValueError):
    """A catalogue table cannot be read: not parsable, or a required column is missing."""


@dataclass
class RawTable:
    """A parsed table: its column names, its rows reduced (None for a JSONL file without records), and
    each row's place in the file."""

    names: list[str]
    cells: Cells | None
    lines: np.ndarray  # (N,) int64


def parse_table(uri: str, stamp_column: str = "") -> RawTable:
    """Read and parse the table by its suffix."""
    suffix = next((s for s in TABLE_SUFFIXES if str(uri).lower().endswith(s)), None)
    if suffix is None:
        raise TableError(f"{uri} is not a catalogue table: its name must end in one of "
                         f"{list(TABLE_SUFFIXES)}")
    return _PARSERS[suffix](uri, stamp_column)


def _parse_csv(uri: str, stamp_column: str) -> RawTable:
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
            cells = [batch_cells(names, batch.columns, stamp_column) for batch in _batches(reader)]
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


def _parse_jsonl(uri: str, stamp_column: str) -> RawTable:
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
        return RawTable(names, None, np.zeros(0, np.int64))
    _check_columns(uri, names)
    meta = [n for n in names if n not in RESERVED_COLUMNS]

    def text(name: str) -> pa.Array:
        return pa.array([cell_text(r.get(name)) for r in records], pa.string())

    metadata = pa.array([json.dumps({n: json_safe(r.get(n)) for n in meta}, sort_keys=True, allow_nan=False)
                         for r in records], pa.string())
    cells = Cells(text("item_id"), text("image_uri"), text("dataset"), text("label"), metadata,
                  text(stamp_column) if stamp_column else None)
    return RawTable(names, cells, np.asarray(lines, np.int64))


def _parse_parquet(uri: str, stamp_column: str) -> RawTable:
    """Row groups one at a time, each reduced to its cells; row i is row i + 1."""
    import pyarrow.parquet as pq

    source = storage.open_file(uri)
    try:
        file = pq.ParquetFile(source)
        names = _unique_names(uri, file.schema_arrow.names)
        cells = [batch_cells(names, [c.combine_chunks() for c in storage.call(
            "reading", uri, lambda g=g: file.read_row_group(g)).columns], stamp_column)
                 for g in range(file.num_row_groups)]
    except (pa.ArrowInvalid, OSError) as exc:
        if isinstance(exc, storage.StorageError):
            raise
        raise TableError(f"{uri} is not a readable Parquet table ({one_line(exc)})") from exc
    finally:
        source.close()
    return _raw(uri, names, cells, 1)


_PARSERS: dict[str, Callable[[str, str], RawTable]] = {
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


def _raw(uri: str, names: list[str], batches: list[Cells], first_row: int) -> RawTable:
    """The batches' cells as one table's (one array a column), rows numbered from ``first_row``."""
    parts = []
    for f in fields(Cells):  # a column at a time
        chunks = [getattr(c, f.name) for c in batches]
        for c in batches:
            setattr(c, f.name, None)
        parts.append(None if chunks and chunks[0] is None else _joined(chunks))  # versions: none named
    cells = Cells(*parts)
    return RawTable(names, cells, np.arange(first_row, first_row + len(cells.ids), dtype=np.int64))


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
