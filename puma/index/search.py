"""Search every shard of an index and merge their top-k into the global top-k.

IVF shards share one trained coarse quantizer, so on CPU the queries are assigned to their
``nprobe`` nearest lists once and those lists of every shard are scanned in one call, through one IVF
index whose lists stack the shards' lists in place (``backend.stacked_lists``); the result equals
searching one IVF index holding all the vectors. On GPU each shard is searched whole. Flat shards
are exact, so the merged result equals one exact index over all vectors.

Missing results (fewer than k candidates in the probed lists) come back as id -1 / item id ''
with score -inf (ip) or +inf (l2).

``allowed`` (a bool mask over global ids) restricts a search to some items through FAISS ID
selectors, e.g. one dataset's gallery in evaluation. FAISS GPU indexes ignore selectors, so an
index opened on GPU with ``keep_cpu=True`` runs restricted searches (and k above the GPU limit) on
its CPU copies; without them such a search is refused.

Loading: shards load in parallel threads (reading, checksums, FAISS deserialisation and Parquet decoding
release the GIL). Beside its FAISS index each shard keeps an item-id hash lookup (``puma.index.lookup``:
about 12 bytes per item), some stored columns in memory (``Holding.columns``, compact Arrow) and others
in a local column file read a few rows at a time (``Holding.file_columns``, ``puma.index.cache``);
``Holding.lists_on_disk`` moves IVF shards' inverted lists to memory-mapped files in the same local
folder (identical results; page cache instead of heap).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from puma.index import backend
from puma.index.cache import ColumnFile, LocalCache, read_compact
from puma.index.filtered import (
    SOURCE_COLUMNS,
    brute_force,
    exact_topk,
    filter_table,
    filtered_nprobe,
    merged_description,
    merged_types,
)
from puma.index.filters import Filter, check_filter, evaluate
from puma.index.layout import IndexFolder
from puma.index.lookup import IdLookup, hash_id, hash_ids
from puma.index.manifest import (
    FileEntry,
    IndexIntegrityError,
    Manifest,
    ShardEntry,
    live_rows,
    read_checked,
    read_manifest,
    removed_ids,
)
from puma.index.plan import IndexInputError
from puma.index.table import EMBEDDING, ITEM_ID, embedding_matrix, read_columns, read_rows
from puma.index.verify import verify

if TYPE_CHECKING:
    import faiss

log = logging.getLogger(__name__)
LOAD_THREADS = 8  # shards loaded at once (at most the CPU count)
_GPU_LOCK = threading.Lock()  # copies to GPUs one at a time


@dataclass(frozen=True)
class Selection:
    """Rows a restricted search may return, as FAISS wants them: a bitmap over global ids."""

    bits: np.ndarray  # (ceil(size/8),) uint8, little-endian bit order (empty when ``rows`` is set)
    size: int  # global ids covered
    count: int = -1  # rows selected (-1: not counted); an IVF search looks further the fewer there are
    rows: np.ndarray | None = None  # the selected rows, ascending, when few enough to scan exactly
    vectors: np.ndarray | None = None  # their embeddings (rows, E), gathered once for a repeated filter


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


def merge_topk(scores: list[np.ndarray], ids: list[np.ndarray], k: int,
               largest: bool) -> tuple[np.ndarray, np.ndarray]:
    """Global top-k from per-shard top-k lists: S x (Q, k) -> (Q, k); ids -1 sort last."""
    all_scores = np.concatenate(scores, axis=1)  # (Q, S*k)
    all_ids = np.concatenate(ids, axis=1)  # (Q, S*k)
    key = -all_scores if largest else all_scores.copy()
    key[all_ids < 0] = np.inf
    order = np.argsort(key, axis=1, kind="stable")[:, :k]  # (Q, k)
    top_scores = np.take_along_axis(all_scores, order, axis=1)
    top_ids = np.take_along_axis(all_ids, order, axis=1)
    top_scores[top_ids < 0] = -np.inf if largest else np.inf
    return top_scores, top_ids


class ShardedIndex:
    """The committed shards of one index, searched together (``ShardedIndex.open(uri)``).

    Rows: the shards' Parquet rows concatenated in shard order, 0..ntotal-1. Search results, item
    lookups, ``allowed`` masks and ``rows`` speak rows, which equal the FAISS global ids until a
    compaction leaves a gap in the ids. Removed (tombstoned) rows stay as rows with a null item id,
    are taken out of the FAISS shards as they load, and are never returned (``live`` is False).
    """

    def __init__(self, uri: str, manifest: Manifest, trained: faiss.Index, loaded: list[LoadedShard],
                 on_gpu: bool, nprobe: int, query_chunk: int = 65536, keep_cpu: bool = False,
                 use_gpu: bool = False, holding: Holding = Holding()) -> None:
        self.uri, self.manifest, self.on_gpu = uri, manifest, on_gpu
        self.nprobe, self.query_chunk, self.use_gpu, self.holding = nprobe, query_chunk, use_gpu, holding
        self._trained = trained  # owns the shared coarse quantizer
        ivf = backend.ivf_of(trained)
        self._cpu_coarse = ivf.quantizer if ivf is not None else None  # preassigned search on CPU
        self._coarse = None if on_gpu else self._cpu_coarse
        self._loaded = loaded
        self._ivfs: dict[int, faiss.IndexIVF] = {}  # id(CPU shard) -> its IVF view (_ivf)
        self._shards = [s.index for s in loaded]
        cpu_copies = [s.cpu_index for s in loaded] if keep_cpu else None
        self._cpu_shards = self._shards if not on_gpu else cpu_copies
        self._stacked, self._stacked_refs = None, None  # the CPU shards' IVF lists as one index
        if ivf is not None and self._cpu_shards:
            self._stacked, self._stacked_refs = backend.stacked_lists(trained, self._cpu_shards)
        self._starts = np.array([s.entry.id_start for s in loaded], dtype=np.int64)  # first global id
        counts = [s.entry.count for s in loaded]
        self._offsets = np.cumsum([0] + counts)[:-1].astype(np.int64)  # first row of each shard
        self._ntotal = int(sum(counts))
        self._gapless = bool(np.array_equal(self._starts, self._offsets))
        self.live = np.concatenate([s.live for s in loaded]) if loaded else np.zeros(0, bool)  # (N,) bool
        self.live_total = int(self.live.sum())

    @classmethod
    def open(cls, uri: str, nprobe: int = 16, use_gpu: bool = True, check: bool = False,
             query_chunk: int = 65536, keep_cpu: bool = False,
             manifest: Manifest | None = None, holding: Holding = Holding()) -> ShardedIndex:
        """Load every committed shard, in parallel (checksums checked as loaded; ``check`` runs a full
        verify).

        ``uri`` may be an index location with versions: its live version is opened.
        ``keep_cpu``: on GPU, also keep the CPU shards for restricted (``allowed``) searches.
        ``manifest``: the shards to load (e.g. one partition's, puma.serve.partitions), default all.
        ``holding``: the stored columns kept per shard, where, and whether IVF lists go on disk.
        """
        from puma.index.versions import resolve

        uri = resolve(uri)
        if check:
            verify(uri).raise_if_bad()
        manifest = manifest or read_manifest(uri)
        if not manifest.shards:
            raise IndexInputError(f"index {uri} has no shards yet; add items before searching")
        with ThreadPoolExecutor(1) as pool:
            trained = pool.submit(lambda: backend.deserialize(_read_checked(uri, manifest.trained)))
            loaded = _load_shards(uri, manifest.shards, use_gpu, keep_cpu, holding, {})
            trained = trained.result()
        on_gpu = any(s.on_gpu for s in loaded)
        return cls(uri, manifest, trained, loaded, on_gpu, nprobe, query_chunk, keep_cpu, use_gpu, holding)

    def refreshed(self, manifest: Manifest | None = None) -> ShardedIndex:
        """This index as ``manifest`` says it is now, loading only the shards that are new or whose
        removals changed (itself when nothing did; a shard whose removals changed keeps its columns and
        id lookup). Another trained index (a rebuild) opens anew."""
        manifest = manifest or read_manifest(self.uri)
        keep_cpu = self._cpu_shards is not None and self.on_gpu
        if manifest.trained.sha256 != self.manifest.trained.sha256:
            return ShardedIndex.open(self.uri, self.nprobe, self.use_gpu, query_chunk=self.query_chunk,
                                     keep_cpu=keep_cpu, holding=self.holding)
        if [_fingerprint(s) for s in manifest.shards] == [_fingerprint(s) for s in self.manifest.shards]:
            return self
        have = {_fingerprint(s.entry): s for s in self._loaded}
        new = [e for e in manifest.shards if _fingerprint(e) not in have]
        same_rows = {s.entry.embeddings.sha256: s for s in self._loaded}  # removals do not change rows
        fresh = {_fingerprint(s.entry): s
                 for s in _load_shards(self.uri, new, self.on_gpu, keep_cpu, self.holding, same_rows)}
        loaded = [have.get(_fingerprint(e)) or fresh[_fingerprint(e)] for e in manifest.shards]
        return ShardedIndex(self.uri, manifest, self._trained, loaded, self.on_gpu, self.nprobe,
                            self.query_chunk, keep_cpu, self.use_gpu, self.holding)

    def reused_shards(self, other: ShardedIndex) -> int:
        """How many of this index's loaded shards are the very objects ``other`` holds (refresh tests)."""
        theirs = {id(s) for s in other._loaded}
        return sum(id(s) in theirs for s in self._loaded)

    def cache_files(self) -> set[str]:
        """The files of ``holding.cache`` this index's shards use (columns, on-disk lists)."""
        return {name for s in self._loaded for name in s.files}

    def shard_columns(self, column: str) -> list[pa.Array]:
        """A column held in memory (``holding.columns``) as one array per shard, in row order (removed
        rows too)."""
        return [s.arrays[column] for s in self._loaded]

    @property
    def ntotal(self) -> int:
        """Rows (the length of ``live`` and of ``allowed`` masks), removed ones included."""
        return self._ntotal

    @property
    def dim(self) -> int:
        return self.manifest.dim

    def search(self, queries: np.ndarray, k: int, nprobe: int | None = None,
               allowed: np.ndarray | Selection | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k over all shards: queries (Q, E) -> scores (Q, k) float32, item ids (Q, k) str ('' pads
        when ``allowed`` leaves fewer than k)."""
        scores, ids = self.search_ids(queries, k, nprobe, allowed)
        return scores, self.to_item_ids(ids)

    def search_ids(self, queries: np.ndarray, k: int, nprobe: int | None = None,
                   allowed: np.ndarray | Selection | None = None,
                   widen: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Top-k over all shards as rows: (Q, E) -> (Q, k) scores, (Q, k) int64 rows.

        ``allowed``: bool (N,) over rows, or its ``select``-ed form (prepared once, reused by many
        searches); only those are returned (-1 pads when fewer than k). On IVF the search visits more
        lists the fewer rows are allowed, up to all of them, and a query left with fewer hits than
        allowed rows is searched again over every list (``puma.index.filtered``); ``widen=False``
        visits exactly ``nprobe`` lists (evaluation: the index as configured).
        """
        q = self._check_queries(queries, k)
        nprobe = nprobe or self.nprobe
        if allowed is None:
            return self._search_all(q, k, nprobe, None)
        chosen = allowed if isinstance(allowed, Selection) else self.select(allowed)
        if chosen.size != (self.ntotal if self._gapless else self.manifest.next_id):
            raise IndexInputError(f"this selection covers {chosen.size} ids; it was made for another "
                                  "state of the index (select again)")
        if widen and chosen.rows is not None:  # few rows: an exact scan of their vectors
            vectors = chosen.vectors if chosen.vectors is not None else self.vectors_at(chosen.rows)
            return exact_topk(vectors, chosen.rows, q, k, self.manifest.metric)
        selector, nlist = backend.bitmap_selector(self._bits(chosen)), self.manifest.nlist
        if nlist and widen and chosen.count >= 0:
            nprobe = filtered_nprobe(nprobe, nlist, chosen.count, self.live_total)
        scores, rows = self._search_all(q, k, nprobe, selector)
        if nlist and widen and nprobe < nlist:
            wanted = k if chosen.count < 0 else min(k, chosen.count)
            short = (rows >= 0).sum(axis=1) < wanted  # (Q,)
            if short.any():
                scores[short], rows[short] = self._search_all(q[short], k, nlist, selector)
        return scores, rows

    def _search_all(self, q: np.ndarray, k: int, nprobe: int,
                    selector: faiss.IDSelector | None) -> tuple[np.ndarray, np.ndarray]:
        parts = [self._search_chunk(q[i:i + self.query_chunk], k, nprobe, selector)
                 for i in range(0, len(q), self.query_chunk)]
        return np.concatenate([p[0] for p in parts]), self._to_rows(np.concatenate([p[1] for p in parts]))

    @cached_property
    def filter_types(self) -> dict[str, str]:
        """The filterable columns and their types over every shard (``puma.index.filtered``)."""
        return merged_types(self._filter_tables())

    def filter_mask(self, where: Filter, unknown_ok: bool = False) -> np.ndarray:
        """Rows (N,) ``where`` selects, removed rows never; a FilterError names a column this index lacks
        (unless ``unknown_ok``: such a column matches nothing) or a value of the wrong type."""
        check_filter(where, self.filter_types, unknown_ok)
        tables = self._filter_tables()
        if not tables:
            return np.zeros(0, dtype=bool)
        return np.concatenate([evaluate(where, t) for t in tables]) & self.live

    def describe_filters(self, max_values: int = 50) -> dict:
        """The filterable columns: their types and, for text columns with few values, the values."""
        return merged_description(self._filter_tables(), [s.live for s in self._loaded], max_values)

    def _filter_tables(self) -> list[pa.Table]:
        if not self.holding.filters:
            raise IndexInputError("this index was opened without its filter columns: open it with "
                                  "Holding(filters=True) to filter by metadata")
        return [s.filters for s in self._loaded]

    def select(self, allowed: np.ndarray) -> Selection:
        """A bool mask (N,) over rows as a restricted search's bitmap over FAISS global ids (N/8 bytes)."""
        rows_mask = self._check_allowed(allowed)
        size = self.ntotal if self._gapless else self.manifest.next_id
        count = int(np.count_nonzero(rows_mask))
        if brute_force(count, self.dim):  # scanned exactly: FAISS's bitmap is never needed
            return Selection(np.zeros(0, np.uint8), size, count, np.flatnonzero(rows_mask))
        return Selection(self._bitmap(rows_mask), size, count)

    def _bits(self, chosen: Selection) -> np.ndarray:
        """FAISS's bitmap of a selection (made from its rows when it was left out: a scan needs none)."""
        if chosen.rows is None or len(chosen.bits):
            return chosen.bits
        rows_mask = np.zeros(self.ntotal, dtype=bool)
        rows_mask[chosen.rows] = True
        return self._bitmap(rows_mask)

    def _bitmap(self, rows_mask: np.ndarray) -> np.ndarray:
        """A bool mask over rows as FAISS's packed bitmap over global ids."""
        return np.packbits(self._id_mask(rows_mask), bitorder="little")

    def with_vectors(self, chosen: Selection) -> Selection:
        """``chosen`` holding its rows' embeddings, so that its scans skip the gather (a selection
        scanned exactly; others are returned as they are)."""
        if chosen.rows is None or chosen.vectors is not None:
            return chosen
        return dataclasses.replace(chosen, vectors=self.vectors_at(chosen.rows))

    def vectors_at(self, rows: np.ndarray) -> np.ndarray:
        """The stored embeddings of rows (n,), ascending, as (n, E) float32: from the held embedding
        column (in memory or mapped from the column file), else read from the shards' Parquet."""
        shard, local = self.locate(rows)
        bounds = np.searchsorted(shard, np.arange(len(self._loaded) + 1))
        out = np.empty((len(rows), self.dim), dtype=np.float32)
        for s in np.flatnonzero(np.diff(bounds)):
            at = slice(bounds[s], bounds[s + 1])
            loaded = self._loaded[s]
            if loaded.holds(EMBEDDING):
                loaded.vectors(local[at], out[at])
            else:
                out[at] = embedding_matrix(self.rows(rows[at], [ITEM_ID, EMBEDDING]))
        return out

    def _to_rows(self, ids: np.ndarray) -> np.ndarray:
        """FAISS global ids (any shape, -1: none) -> rows (same shape, -1: none)."""
        if self._gapless:
            return ids
        flat = ids.ravel()
        shard = np.maximum(np.searchsorted(self._starts, flat, side="right") - 1, 0)
        rows = np.where(flat >= 0, self._offsets[shard] + flat - self._starts[shard], -1)
        return rows.reshape(ids.shape)

    def global_ids(self, rows: np.ndarray) -> np.ndarray:
        """Rows (n,) -> their FAISS global ids (n,): the same item's id in any subset of the shards."""
        rows = np.asarray(rows, dtype=np.int64)
        if self._gapless:
            return rows
        shard = np.searchsorted(self._offsets, rows, side="right") - 1
        return self._starts[shard] + rows - self._offsets[shard]

    def _id_mask(self, rows_mask: np.ndarray) -> np.ndarray:
        """A bool mask over rows -> the same selection as a mask over FAISS global ids."""
        if self._gapless:
            return rows_mask
        rows = np.flatnonzero(rows_mask)
        shard = np.searchsorted(self._offsets, rows, side="right") - 1
        mask = np.zeros(self.manifest.next_id, dtype=bool)
        mask[self._starts[shard] + rows - self._offsets[shard]] = True
        return mask

    def _search_chunk(self, q: np.ndarray, k: int, nprobe: int,
                      selector: faiss.IDSelector | None = None) -> tuple[np.ndarray, np.ndarray]:
        on_cpu = not self.on_gpu or selector is not None or k > backend.GPU_MAX_K
        largest = self.manifest.metric == "ip"
        if on_cpu and self._stacked is not None:  # IVF on CPU: every shard's lists in one scan
            nprobe = min(nprobe, self.manifest.nlist)
            coarse_scores, lists = self._cpu_coarse.search(q, nprobe)  # (Q, nprobe) each
            scores, ids = backend.search_preassigned(self._stacked, q, k, lists, coarse_scores, selector)
            return merge_topk([scores], [ids], k, largest)  # pads: id -1, score -inf (ip) / +inf (l2)
        shards, coarse = (self._cpu_shards, self._cpu_coarse) if on_cpu else (self._shards, self._coarse)
        if self.manifest.nlist:  # IVF on GPU: every shard visits the same nprobe lists
            nprobe = min(nprobe, self.manifest.nlist)
            for shard in shards:
                backend.set_nprobe(shard, nprobe, True)
        if coarse is None:
            results = [backend.search(shard, q, k, selector) for shard in shards]
        else:
            coarse_scores, lists = coarse.search(q, nprobe)  # (Q, nprobe) each, once for all shards
            results = [backend.search_preassigned(self._ivf(s), q, k, lists, coarse_scores, selector)
                       for s in shards]
        return merge_topk([r[0] for r in results], [r[1] for r in results], k, largest)

    def _ivf(self, shard: faiss.Index) -> faiss.IndexIVF:
        """The IVF view of a CPU shard, looked up once (a SWIG call per shard and query otherwise)."""
        ivf = self._ivfs.get(id(shard))
        if ivf is None:
            ivf = self._ivfs[id(shard)] = backend.ivf_of(shard)
        return ivf

    def _check_allowed(self, allowed: np.ndarray) -> np.ndarray:
        """The mask, if it is a bool (N,) over rows and the index can search restricted."""
        mask = np.asarray(allowed)
        if mask.shape != (self.ntotal,) or mask.dtype != bool:
            raise IndexInputError(f"allowed must be a bool mask of shape ({self.ntotal},) over rows, "
                                  f"got {mask.dtype} {mask.shape}")
        if self._cpu_shards is None:
            raise IndexInputError("FAISS GPU indexes ignore ID selectors: open the index with keep_cpu=True "
                                  "(or use_gpu=False) to search a subset of its items")
        return mask

    def max_k(self) -> int:
        """The most neighbours one search returns: every live item, or FAISS GPU's limit on a GPU-only
        index."""
        gpu_only = self.on_gpu and self._cpu_shards is None
        most = max(self.live_total, 1)
        return min(most, backend.GPU_MAX_K) if gpu_only else most

    def _check_queries(self, queries: np.ndarray, k: int) -> np.ndarray:
        q = np.asarray(queries)
        if q.ndim != 2 or q.shape[1] != self.dim or not np.issubdtype(q.dtype, np.floating):
            raise IndexInputError(f"queries must be a float (Q, {self.dim}) array, got {q.dtype} {q.shape}")
        if not 1 <= k <= self.max_k():
            raise IndexInputError(f"k must be in [1, {self.max_k()}] for this index, got {k}")
        if not np.isfinite(q).all():
            raise IndexInputError("queries have NaN or Inf values")
        return np.ascontiguousarray(q, dtype=np.float32)

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows (n,) -> (the shard of each (n,), the row within it (n,))."""
        rows = np.asarray(rows, dtype=np.int64)
        shard = np.searchsorted(self._offsets, rows, side="right") - 1
        return shard, rows - self._offsets[shard]

    def to_item_ids(self, ids: np.ndarray) -> np.ndarray:
        """Rows (any shape, -1 for none) -> item ids (same shape, '' for none or removed)."""
        flat = np.asarray(ids, dtype=np.int64).ravel()
        names = np.full(len(flat), "", dtype=object)
        found = np.flatnonzero(flat >= 0)
        found = found[self.live[flat[found]]]
        shard, local = self.locate(flat[found])
        for s in np.unique(shard):
            at = shard == s
            names[found[at]] = self._loaded[s].item_ids_at(local[at])
        return names.reshape(np.shape(ids))

    def describe(self, rows: np.ndarray, columns: list[str]) -> list[dict]:
        """Held columns (in memory or in the column file) of some rows (n,) as n dicts of Python values:
        only those rows' fields are read (a hit list's k rows, not the columns)."""
        shard, local = self.locate(rows)
        loaded = self._loaded
        return [loaded[s].values(r, columns) for s, r in zip(shard.tolist(), local.tolist(), strict=True)]

    def find(self, item_id: str) -> int:
        """The live row of one item id, -1 when the index does not hold it (a hash lookup)."""
        h = np.uint64(hash_id(item_id))
        for shard, offset in zip(self._loaded, self._offsets.tolist(), strict=True):
            row = shard.ids.find(item_id, h, shard.live, shard.item_id)
            if row >= 0:
                return offset + row
        return -1

    def lookup(self, item_ids: list[str] | np.ndarray) -> np.ndarray:
        """Item ids -> rows (int64); raises IndexInputError naming any that are not indexed (or removed)."""
        wanted = [str(x) for x in item_ids]
        hashes = hash_ids(pa.array(wanted, type=pa.string()))  # (n,)
        rows = np.full(len(wanted), -1, dtype=np.int64)
        for shard, offset in zip(self._loaded, self._offsets.tolist(), strict=True):
            todo = np.flatnonzero(rows < 0)
            if not len(todo):
                break
            found = shard.ids.find_many([wanted[i] for i in todo], hashes[todo], shard.live, shard.item_id)
            rows[todo[found >= 0]] = found[found >= 0] + offset
        if (rows < 0).any():
            missing = [wanted[i] for i in np.flatnonzero(rows < 0)[:10]]
            raise IndexInputError(f"{int((rows < 0).sum())} item id(s) are not in index {self.uri}, "
                                  f"e.g. {missing}")
        return rows

    def vector(self, row: int) -> np.ndarray:
        """The stored embedding of one row (E,) float32: from the held embedding column when there is
        one (no Parquet read), else from the shard's Parquet."""
        shard, local = self.locate(np.array([row]))
        loaded = self._loaded[int(shard[0])]
        if loaded.holds(EMBEDDING):
            return np.array(loaded.values(int(local[0]), [EMBEDDING])[EMBEDDING], dtype=np.float32)
        return embedding_matrix(self.rows(np.array([row]), [ITEM_ID, EMBEDDING]))[0]

    def embeddings(self, item_ids: list[str] | np.ndarray) -> np.ndarray:
        """Stored embeddings of indexed items (n,) -> (n, E) float32 (see ``vector``)."""
        rows = self.lookup(item_ids)
        if len(rows) and all(s.holds(EMBEDDING) for s in self._loaded):
            return np.stack([self.vector(r) for r in rows.tolist()])
        return embedding_matrix(self.rows(rows, [ITEM_ID, EMBEDDING]))

    def rows(self, ids: np.ndarray, columns: list[str]) -> pa.Table:
        """Stored columns of items by row (n,), in that order; a column a shard lacks is null."""
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids):
            return pa.table({name: pa.nulls(0) for name in columns})
        shard_of = np.searchsorted(self._offsets, ids, side="right") - 1  # (n,)
        parts, order = [], []
        for s in np.unique(shard_of):
            rows = np.flatnonzero(shard_of == s)
            entry = self.manifest.shards[s]
            part = read_rows(_path(self.uri, entry.embeddings), ids[rows] - self._offsets[s], columns,
                             missing_ok=True)
            parts.append(part)
            order.append(rows)
        table = pa.concat_tables(parts, promote_options="permissive")
        return table.take(pa.array(np.argsort(np.concatenate(order), kind="stable")))

    def table(self, columns: list[str], missing_ok: bool = False) -> pa.Table:
        """Stored columns of every row, removed ones included (see ``live``), in row order
        (``missing_ok``: absent columns are null)."""
        parts = [read_columns(_path(self.uri, shard.embeddings), columns, missing_ok)
                 for shard in self.manifest.shards]
        return pa.concat_tables(parts, promote_options="permissive")

    def search_by_item_id(self, item_ids: list[str] | np.ndarray, k: int, exclude_self: bool = True,
                          nprobe: int | None = None, allowed: np.ndarray | Selection | None = None
                          ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k neighbours of indexed items (their stored embeddings), without the item itself."""
        own = self.lookup(item_ids)  # (n,)
        most = self.max_k() - int(exclude_self)
        if not 1 <= k <= most:
            own_item = "the query item left out" if exclude_self else "the query item included"
            raise IndexInputError(f"k must be in [1, {most}] for this index ({own_item}), got {k}")
        scores, ids = self.search_ids(self.embeddings(item_ids), k + int(exclude_self), nprobe, allowed)
        if exclude_self:
            scores, ids = drop_self(scores, ids, own)
        return scores, self.to_item_ids(ids)


def drop_self(scores: np.ndarray, ids: np.ndarray, own: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop each row's own id (or, when absent, its last neighbour): (n, k+1) -> (n, k)."""
    drop = ids == own[:, None]  # (n, k+1)
    first = drop & (np.cumsum(drop, axis=1) == 1)  # only the first match per row
    first[~first.any(axis=1), -1] = True
    keep = ~first
    n, k = ids.shape[0], ids.shape[1] - 1
    return scores[keep].reshape(n, k), ids[keep].reshape(n, k)


def _path(uri: str, entry: FileEntry) -> str:
    return IndexFolder(uri).file(entry.path)


def _read_checked(uri: str, entry: FileEntry) -> bytes:
    return read_checked(uri, entry)


def _fingerprint(shard: ShardEntry) -> tuple:
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
        held = self.arrays.get(EMBEDDING)
        if held is None:
            matrix = self.file.matrix(EMBEDDING)
        else:
            matrix = held.flatten().to_numpy(zero_copy_only=False).reshape(len(held), -1)
        if matrix.dtype == np.float32:
            np.take(matrix, rows, axis=0, out=out)
        else:
            out[:] = matrix[rows]

    def values(self, row: int, columns: list[str]) -> dict:
        """One row's values of ``columns`` as Python objects (an embedding: float32 (E,) from the file)."""
        held, file = self.arrays, self.file
        return {c: held[c][row].as_py() if c in held else file.value(c, row) for c in columns}


def _load_shards(uri: str, entries: list[ShardEntry], use_gpu: bool, keep_cpu: bool, holding: Holding,
                 same_rows: dict[str, LoadedShard]) -> list[LoadedShard]:
    """Load shards in parallel threads, in order (``same_rows``: loaded shards by Parquet sha256, whose
    columns and id lookup a reload reuses)."""
    if not entries:
        return []
    threads = max(1, min(LOAD_THREADS, os.cpu_count() or 1, len(entries)))
    with ThreadPoolExecutor(threads, thread_name_prefix="load-shard") as pool:
        loaded = list(pool.map(lambda e: _load_shard(uri, e, use_gpu, keep_cpu, holding,
                                                     same_rows.get(e.embeddings.sha256)), entries))
    pa.default_memory_pool().release_unused()  # what decoding the Parquet columns took
    backend.trim_heap()
    return loaded


def _load_shard(uri: str, entry: ShardEntry, use_gpu: bool, keep_cpu: bool, holding: Holding = Holding(),
                rows_of: LoadedShard | None = None) -> LoadedShard:
    """A shard's index (checksum checked), less its removed ids, on the search device; its columns and
    id lookup (``rows_of``: a loaded shard of the same Parquet file to take them from)."""
    cpu_index = backend.deserialize(_read_checked(uri, entry.index))
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
    return LoadedShard(entry, index, kept, arrays, file, live, ids, on_gpu, files, filters)


def _load_columns(uri: str, entry: ShardEntry, holding: Holding) -> tuple[
        dict[str, pa.Array], ColumnFile | None, IdLookup, tuple[str, ...], pa.Table | None]:
    """The shard's columns held in memory (one array each), its column file (and that file's name in
    the cache), its item-id lookup and its filter table (``holding.filters``)."""
    extra = SOURCE_COLUMNS if holding.filters else ()
    names = list(dict.fromkeys((*holding.columns, *holding.file_columns, *extra)))
    table = read_compact(_path(uri, entry.embeddings), names, holding.schema)
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
