"""Embedding tables: the columns the index needs, conversion to float32 matrices, Parquet I/O.

An embeddings table has ``item_id`` (string, unique, non-empty) and ``embedding`` (a list or
fixed-size list of floats, all of one length E); any other columns (dataset, label, class_name,
split, source_path, ...) are kept as they are in the shard's Parquet. The index adds ``index_id``
(int64), the global FAISS id of the row.
"""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from puma import storage
from puma.index.plan import IndexInputError

ITEM_ID = "item_id"
EMBEDDING = "embedding"
INDEX_ID = "index_id"

# Columns that jobs/embed.py writes beside item_id and embedding (the catalogue contract; the
# index itself needs only the two above). Evaluation and retrieval grids read them.
DATASET = "dataset"  # string: dataset / catalogue name the item belongs to
LABEL = "label"  # int64: class within its dataset; -1 when the catalogue has no labels
ROLE = "role"  # string: query | gallery | train (puma.data.schema roles)
CATALOGUE = "catalogue"  # string: the catalogue URI the item was embedded from
IMAGE_URI = "image_uri"  # string: where the image bytes are (an image file, or a Parquet file)
IMAGE_ROW = "image_row"  # int64: -1 when image_uri is an image file, else the row in that Parquet
CLASS_NAME = "class_name"  # string: the label's name ('' when unknown)
METADATA = "metadata"  # string: a JSON object of a catalogue table's other columns ('{}' when none)
STAMP = "stamp"  # string: what the catalogue listing says of the image (size:mtime, or shard#row)
FINGERPRINT = "fingerprint"  # string: sha256:<hex> of the image bytes that were embedded
NO_LABEL = -1
ROW_GROUP_ROWS = 8192  # rows per Parquet row group; search_by_item_id reads only the groups it needs


def read_table(uri: str) -> pa.Table:
    """A Parquet file or a folder of Parquet files (local or s3://) as one table."""
    files = [uri] if str(uri).endswith(".parquet") else storage.list_files(uri, suffix=".parquet")
    if not files:
        raise IndexInputError(f"no Parquet files at {uri}; expected a .parquet file or a folder of them")
    tables = [pq.read_table(io.BytesIO(storage.read_bytes(f))) for f in files]
    return pa.concat_tables(tables, promote_options="permissive")


def check_table(table: pa.Table) -> pa.Table:
    """Validate the index columns; returns the table with item_id as string and embedding float32."""
    missing = [c for c in (ITEM_ID, EMBEDDING) if c not in table.column_names]
    if missing:
        raise IndexInputError(f"embeddings table lacks column(s) {missing}; it has {table.column_names}")
    if INDEX_ID in table.column_names:
        raise IndexInputError(f"column {INDEX_ID!r} is reserved for the index's own ids; drop it first")
    ids = table[ITEM_ID]
    if not (pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type)):
        raise IndexInputError(f"column item_id must be strings, got {ids.type}")
    bad = int(ids.null_count) + int(pc.sum(pc.equal(pc.utf8_length(ids), 0)).as_py() or 0)
    if bad:
        raise IndexInputError(f"{bad} row(s) have a null or empty item_id")
    return table.set_column(table.schema.get_field_index(EMBEDDING), EMBEDDING,
                            _fixed_float32(table[EMBEDDING], table[ITEM_ID]))


def _fixed_float32(col: pa.ChunkedArray, ids: pa.ChunkedArray) -> pa.Array:
    """The embedding column as fixed_size_list<float32>[E]; raises on nulls or ragged lengths."""
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)
            or pa.types.is_fixed_size_list(arr.type)) or not pa.types.is_floating(arr.type.value_type):
        raise IndexInputError(f"column embedding must be a list of floats, got {arr.type}")
    if len(arr) == 0:
        raise IndexInputError("embeddings table is empty")
    if arr.null_count:
        bad = np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))
        raise IndexInputError(f"{len(bad)} embedding(s) are null, e.g. items {_ids(ids, bad)}")
    lengths = pc.list_value_length(arr).to_numpy()  # (N,)
    ragged = np.flatnonzero(lengths != lengths[0])
    if len(ragged) or lengths[0] < 1:
        raise IndexInputError(f"embeddings must all have length {lengths[0]} (>= 1); "
                              f"{len(ragged)} differ, e.g. items {_ids(ids, ragged)}")
    values = pc.list_flatten(arr).cast(pa.float32())
    return pa.FixedSizeListArray.from_arrays(values, int(lengths[0]))


def _ids(ids: pa.ChunkedArray, rows: np.ndarray, limit: int = 10) -> list[str]:
    return [str(x) for x in ids.take(pa.array(rows[:limit].astype(np.int64))).to_pylist()]


def embedding_dim(table: pa.Table) -> int:
    """E for a checked table."""
    return int(table.schema.field(EMBEDDING).type.list_size)


def embedding_matrix(table: pa.Table) -> np.ndarray:
    """(N, E) float32, C-contiguous; raises on NaN/Inf naming the items."""
    col = table[EMBEDDING]
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    dim = arr.type.list_size
    x = arr.flatten().to_numpy(zero_copy_only=False).reshape(len(arr), dim)  # (N, E)
    finite = np.isfinite(x).all(axis=1)
    if not finite.all():
        bad = [str(table[ITEM_ID][int(i)]) for i in np.flatnonzero(~finite)[:10]]
        raise IndexInputError(f"{int((~finite).sum())} embedding(s) have NaN or Inf values, e.g. {bad}")
    return np.ascontiguousarray(x, dtype=np.float32)


def first_occurrences(table: pa.Table) -> tuple[pa.Table, int, list[str]]:
    """Rows whose item_id appears for the first time; (kept, repeats dropped, examples)."""
    rows = pa.array(np.arange(len(table), dtype=np.int64))
    firsts = (pa.table({ITEM_ID: table[ITEM_ID], "_row": rows})
              .group_by(ITEM_ID).aggregate([("_row", "min")])["_row_min"])
    if len(firsts) == len(table):
        return table, 0, []
    mask = np.ones(len(table), dtype=bool)
    mask[firsts.to_numpy()] = False  # True for repeats
    return table.filter(pa.array(~mask)), int(mask.sum()), _ids(table[ITEM_ID], np.flatnonzero(mask))


def drop_indexed(table: pa.Table, indexed: pa.Array) -> tuple[pa.Table, int, list[str]]:
    """Rows whose item_id is not in ``indexed``; (kept, dropped count, examples)."""
    if len(indexed) == 0 or len(table) == 0:
        return table, 0, []
    seen = pc.is_in(table[ITEM_ID], value_set=indexed)
    dropped = int(pc.sum(seen).as_py() or 0)
    examples = [str(x) for x in table.filter(seen)[ITEM_ID][:10].to_pylist()]
    return table.filter(pc.invert(seen)), dropped, examples


def to_parquet_bytes(table: pa.Table) -> bytes:
    """The table as Parquet bytes (zstd, row groups of ROW_GROUP_ROWS)."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", row_group_size=ROW_GROUP_ROWS)
    return sink.getvalue().to_pybytes()


def read_columns(uri: str, columns: list[str], missing_ok: bool = False) -> pa.Table:
    """Some columns of one Parquet file (local or s3://), read without the others.

    ``missing_ok``: columns the file lacks come back as all-null columns instead of raising.
    """
    fs, path = storage.resolve(uri)

    def _read() -> pa.Table:
        with fs.open_input_file(path) as f:
            pf = pq.ParquetFile(f)
            present = [c for c in columns if c in pf.schema_arrow.names] if missing_ok else columns
            return pf.read(columns=present)

    part = storage.call("reading", uri, _read)
    for name in columns:
        if name not in part.column_names:
            part = part.append_column(name, pa.nulls(len(part)))
    return part.select(columns)


def read_rows(uri: str, rows: np.ndarray, columns: list[str], missing_ok: bool = False) -> pa.Table:
    """Rows (in the given order) of one Parquet file, reading only the row groups that hold them.

    ``missing_ok``: columns the file lacks come back as all-null columns instead of raising.
    """
    fs, path = storage.resolve(uri)

    def _read() -> tuple[pa.Table, np.ndarray]:
        with fs.open_input_file(path) as f:
            pf = pq.ParquetFile(f)
            present = [c for c in columns if c in pf.schema_arrow.names] if missing_ok else columns
            sizes = np.array([pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)])
            groups = np.unique(_group_of(sizes, rows)[1])
            return pf.read_row_groups([int(g) for g in groups], columns=present), sizes

    part, sizes = storage.call("reading", uri, _read)
    if not part.num_columns:  # none of the columns is stored: nulls, one per wanted row
        return pa.table({name: pa.nulls(len(rows)) for name in columns})
    wanted = columns
    starts, group_of = _group_of(sizes, rows)
    groups = np.unique(group_of)
    base = np.concatenate([[0], np.cumsum(sizes[groups])])[:-1]  # where each group starts in part
    local = base[np.searchsorted(groups, group_of)] + rows - starts[group_of]
    part = part.take(pa.array(local.astype(np.int64)))
    for name in wanted:
        if name not in part.column_names:
            part = part.append_column(name, pa.nulls(len(part)))
    return part.select(wanted)


def _group_of(sizes: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first row of each row group (G+1,), the row group of each wanted row)."""
    starts = np.concatenate([[0], np.cumsum(sizes)])  # (G+1,)
    return starts, np.searchsorted(starts, rows, side="right") - 1
