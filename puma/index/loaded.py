"""Shards loaded for search: how they are held besides their FAISS index (``Holding``), each loaded
shard (``LoadedShard``), and loading them.

Loading: shards load in parallel threads (reading, checksums, FAISS deserialisation and Parquet decoding
release the GIL). Beside its FAISS index each shard keeps an item-id hash lookup (``puma.index.lookup``:
about 12 bytes per item), some stored columns in memory (``Holding.columns``, compact Arrow) and others
in a local column file read a few rows at a time (``Holding.file_columns``, ``puma.index.cache``);
``Holding.lists_on_disk`` moves IVF shards' inverted lists to memory-mapped files in the same local
folder (identical results; page cache instead of heap). A shard's removed ids are taken out of its FAISS
index as it loads. ``puma.index.search.ShardedIndex`` searches the loaded shards together.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from puma.index import backend
from puma.index.cache import ColumnFile, LocalCache, read_compact
from puma.index.filtered import SOURCE_COLUMNS, filter_table
from puma.index.layout import IndexFolder
from puma.index.lookup import IdLookup
from puma.index.manifest import IndexIntegrityError, ShardEntry, live_rows, read_checked, removed_ids
from puma.index.plan import IndexInputError
from puma.index.ranges import SortedColumn, sorted_column
from puma.index.table import EMBEDDING, ITEM_ID

if TYPE_CHECKING:
    import faiss

LOAD_THREADS = 8  # shards loaded at once (at most the CPU count)
_GPU_LOCK = threading.Lock()  # copies to GPUs one at a time


@dataclass(frozen=True)
class Holding:
    """How loaded shards are held besides their FAISS index: the stored columns kept in memory
    (``columns``) and those written to a local column file in ``cache`` and read by row
    (``file_columns``; item_id is in one of them), their types (``schema``, see
    ``puma.index.cache.compact_table``), and whether IVF lists go to memory-mapped files in ``cache``."""

    columns: tuple[str, ...] = (ITEM_ID,)
    file_columns: tuple[str, ...] = ()
    schema: pa.Schema | None = None
    cache: LocalCache | None = None
    lists_on_disk: bool = False
    filters: bool = False  # each shard's filter table (puma.index.filtered) held for filtered searches

    def __post_init__(self) -> None:
        if ITEM_ID not in self.columns + self.file_columns:
            object.__setattr__(self, "columns", (ITEM_ID, *self.columns))
        if (self.lists_on_disk or self.file_columns) and self.cache is None:
            raise IndexInputError("column files and lists on disk need a local cache folder (Holding.cache)")


def fingerprint(shard: ShardEntry) -> tuple:
    """What identifies a loaded shard: a shard whose fingerprint is unchanged need not load again."""
    removed = shard.removed.sha256 if shard.removed else ""
    return shard.name, shard.index.sha256, shard.embeddings.sha256, shard.id_start, shard.count, removed


@dataclass
class LoadedShard:
    """One shard in memory: its FAISS index (removed ids taken out), the CPU copy, its columns held in
    memory and in a local column file, which rows are live, the item-id lookup, its cache files."""

    entry: ShardEntry
    index: faiss.Index
    cpu_index: faiss.Index | None
    arrays: dict[str, pa.Array]  # holding.columns -> (count,) values (removed rows keep theirs)
    file: ColumnFile | None  # holding.file_columns
    live: np.ndarray  # (count,) bool: False where removed
    ids: IdLookup
    on_gpu: bool
    files: tuple[str, ...] = ()  # names in holding.cache
    filters: pa.Table | None = None  # holding.filters: the shard's filter table (puma.index.filtered)
    _row_lists: np.ndarray | None = None  # each row's IVF list, made at the first scan that needs it
    sorted_columns: dict[str, SortedColumn | None] = field(default_factory=dict, repr=False)  # made at
    # a column's first range filter; shared with a reload of the same Parquet file (same filter table)

    def sorted_column(self, name: str) -> SortedColumn | None:
        """The filter table's number column ``name`` sorted (``puma.index.ranges``), made once."""
        if name not in self.sorted_columns:
            self.sorted_columns[name] = sorted_column(self.filters, name)
        return self.sorted_columns[name]

    def row_lists(self, cpu_index: faiss.Index, nlist: int) -> np.ndarray:
        """Each row's inverted list in ``cpu_index`` (this shard's CPU IVF index; -1: removed), made
        once per loaded shard: a refresh that keeps the shard keeps them."""
        if self._row_lists is None:
            self._row_lists = backend.lists_of_rows(cpu_index, self.entry.id_start, self.entry.count, nlist)
        return self._row_lists

    def holds(self, column: str) -> bool:
        return column in self.arrays or (self.file is not None and column in self.file.names)

    def item_id(self, row: int) -> str:
        ids = self.arrays.get(ITEM_ID)
        return ids[row].as_py() if ids is not None else self.file.value(ITEM_ID, row)

    def item_ids_at(self, rows: np.ndarray) -> list[str]:
        ids = self.arrays.get(ITEM_ID)
        if ids is not None:
            return ids.take(pa.array(rows, pa.int64())).to_pylist()
        return [self.file.value(ITEM_ID, r) for r in rows.tolist()]

    def vectors(self, rows: np.ndarray, out: np.ndarray) -> None:
        """The held embedding column at rows (n,) into ``out`` (n, E) float32."""
        matrix = self.matrix()
        if matrix.dtype == np.float32:
            np.take(matrix, rows, axis=0, out=out)
        else:
            out[:] = matrix[rows]

    def matrix(self) -> np.ndarray:
        """The held embedding column as an (n, E) array: mapped from the column file, or over the
        Arrow column in memory (call only where ``holds(EMBEDDING)``)."""
        held = self.arrays.get(EMBEDDING)
        if held is None:
            return self.file.matrix(EMBEDDING)
        return held.flatten().to_numpy(zero_copy_only=False).reshape(len(held), -1)

    def values(self, row: int, columns: list[str]) -> dict:
        """One row's values of ``columns`` as Python objects (an embedding: float32 (E,) from the file)."""
        held, file = self.arrays, self.file
        return {c: held[c][row].as_py() if c in held else file.value(c, row) for c in columns}


def load_shards(uri: str, entries: list[ShardEntry], use_gpu: bool, keep_cpu: bool, holding: Holding,
                 same_rows: dict[str, LoadedShard]) -> list[LoadedShard]:
    """Load shards in parallel threads, in order (``same_rows``: loaded shards by Parquet sha256, whose
    columns and id lookup a reload reuses)."""
    if not entries:
        return []
    threads = max(1, min(LOAD_THREADS, os.cpu_count() or 1, len(entries)))
    with ThreadPoolExecutor(threads, thread_name_prefix="load-shard") as pool:
        loaded = list(pool.map(lambda e: load_shard(uri, e, use_gpu, keep_cpu, holding,
                                                     same_rows.get(e.embeddings.sha256)), entries))
    pa.default_memory_pool().release_unused()  # what decoding the Parquet columns took
    backend.trim_heap()
    return loaded


def load_shard(uri: str, entry: ShardEntry, use_gpu: bool, keep_cpu: bool, holding: Holding = Holding(),
                rows_of: LoadedShard | None = None) -> LoadedShard:
    """A shard's index (checksum checked), less its removed ids, on the search device; its columns and
    id lookup (``rows_of``: a loaded shard of the same Parquet file to take them from)."""
    cpu_index = backend.deserialize(read_checked(uri, entry.index))
    if rows_of is not None:
        arrays, file, ids, filters = rows_of.arrays, rows_of.file, rows_of.ids, rows_of.filters
        files = rows_of.files[:1] if file is not None else ()
    else:
        arrays, file, ids, files, filters = _load_columns(uri, entry, holding)
    removed = removed_ids(uri, entry)  # (R,) global ids
    live = np.ones(entry.count, dtype=bool)
    if len(removed):
        cpu_index.remove_ids(removed)
        live = live_rows(uri, entry, removed)  # the removed-ids file is read once
    if use_gpu:
        with _GPU_LOCK:
            index, on_gpu = backend.to_search_device(cpu_index, use_gpu)
    else:
        index, on_gpu = cpu_index, False
    kept = cpu_index if keep_cpu or not on_gpu else None
    if kept is not None and holding.lists_on_disk:
        name = f"{entry.index.sha256[:16]}-{entry.removed.sha256[:16] if entry.removed else 'none'}.ivfdata"
        path = holding.cache.path(name)
        if os.path.exists(path):  # an earlier load of this very shard: its mapping (if any) stays valid
            os.unlink(path)
        if backend.lists_on_disk(kept, path):
            files = (*files, name)
    return LoadedShard(entry, index, kept, arrays, file, live, ids, on_gpu, files, filters,
                       sorted_columns=rows_of.sorted_columns if rows_of is not None else {})


def _load_columns(uri: str, entry: ShardEntry, holding: Holding) -> tuple[
        dict[str, pa.Array], ColumnFile | None, IdLookup, tuple[str, ...], pa.Table | None]:
    """The shard's columns held in memory (one array each), its column file (and that file's name in
    the cache), its item-id lookup and its filter table (``holding.filters``)."""
    extra = SOURCE_COLUMNS if holding.filters else ()
    names = list(dict.fromkeys((*holding.columns, *holding.file_columns, *extra)))
    table = read_compact(IndexFolder(uri).file(entry.embeddings.path), names, holding.schema)
    if table.num_rows != entry.count:
        raise IndexIntegrityError(f"{entry.name}: {table.num_rows} Parquet rows; manifest says {entry.count}")
    if table[ITEM_ID].null_count:
        raise IndexIntegrityError(f"{entry.name}: {table[ITEM_ID].null_count} row(s) have no item id")
    ids = IdLookup(table[ITEM_ID])
    arrays = {c: _one_chunk(table[c]) for c in holding.columns}
    filters = filter_table(table.select(list(SOURCE_COLUMNS))) if holding.filters else None
    if not holding.file_columns:
        return arrays, None, ids, (), filters
    file, name = holding.cache.column_file(entry.embeddings.sha256, table.select(list(holding.file_columns)))
    return arrays, file, ids, (name,), filters


def _one_chunk(column: pa.ChunkedArray) -> pa.Array:
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
