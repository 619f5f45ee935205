"""Search every shard of an index and merge their top-k into the global top-k.

IVF shards share one trained coarse quantizer, so on CPU the queries are assigned to their
``nprobe`` nearest lists once and every shard scans those lists (``search_preassigned``); the
result equals searching one IVF index holding all the vectors. On GPU each shard is searched
whole. Flat shards are exact, so the merged result equals one exact index over all vectors.

Missing results (fewer than k candidates in the probed lists) come back as id -1 / item id ''
with score -inf (ip) or +inf (l2).

``allowed`` (a bool mask over global ids) restricts a search to some items through FAISS ID
selectors, e.g. one dataset's gallery in evaluation. FAISS GPU indexes ignore selectors, so an
index opened on GPU with ``keep_cpu=True`` runs restricted searches (and k above the GPU limit) on
its CPU copies; without them such a search is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from puma import storage
from puma.index import backend
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
                 use_gpu: bool = False) -> None:
        self.uri, self.manifest, self.on_gpu = uri, manifest, on_gpu
        self.nprobe, self.query_chunk, self.use_gpu = nprobe, query_chunk, use_gpu
        self._trained = trained  # owns the shared coarse quantizer
        ivf = backend.ivf_of(trained)
        self._cpu_coarse = ivf.quantizer if ivf is not None else None  # preassigned search on CPU
        self._coarse = None if on_gpu else self._cpu_coarse
        self._loaded = loaded
        self._ivfs: dict[int, faiss.IndexIVF] = {}  # id(CPU shard) -> its IVF view (_ivf)
        self._shards = [s.index for s in loaded]
        cpu_copies = [s.cpu_index for s in loaded] if keep_cpu else None
        self._cpu_shards = self._shards if not on_gpu else cpu_copies
        self._item_ids = _concat([s.item_ids for s in loaded])  # (N,) item id of each row, null: removed
        self._starts = np.array([s.entry.id_start for s in loaded], dtype=np.int64)  # first global id
        self._offsets = np.cumsum([0] + [s.entry.count for s in loaded])[:-1].astype(np.int64)  # first row
        self._gapless = bool(np.array_equal(self._starts, self._offsets))
        self.live = self._item_ids.is_valid().to_numpy(zero_copy_only=False)  # (N,) bool
        self.live_total = int(self.live.sum())

    @classmethod
    def open(cls, uri: str, nprobe: int = 16, use_gpu: bool = True, check: bool = False,
             query_chunk: int = 65536, keep_cpu: bool = False,
             manifest: Manifest | None = None) -> ShardedIndex:
        """Load every committed shard (checksums checked as loaded; ``check`` runs a full verify).

        ``uri`` may be an index location with versions: its live version is opened.
        ``keep_cpu``: on GPU, also keep the CPU shards for restricted (``allowed``) searches.
        ``manifest``: the shards to load (e.g. one partition's, puma.serve.partitions), default all.
        """
        from puma.index.versions import resolve

        uri = resolve(uri)
        if check:
            verify(uri).raise_if_bad()
        manifest = manifest or read_manifest(uri)
        if not manifest.shards:
            raise IndexInputError(f"index {uri} has no shards yet; add items before searching")
        trained = backend.deserialize(_read_checked(uri, manifest.trained))
        loaded = [_load_shard(uri, entry, use_gpu, keep_cpu) for entry in manifest.shards]
        on_gpu = any(s.on_gpu for s in loaded)
        return cls(uri, manifest, trained, loaded, on_gpu, nprobe, query_chunk, keep_cpu, use_gpu)

    def refreshed(self, manifest: Manifest | None = None) -> ShardedIndex:
        """This index as ``manifest`` says it is now, loading only the shards that are new or whose
        removals changed (itself when nothing did). Another trained index (a rebuild) opens anew."""
        manifest = manifest or read_manifest(self.uri)
        keep_cpu = self._cpu_shards is not None and self.on_gpu
        if manifest.trained.sha256 != self.manifest.trained.sha256:
            return ShardedIndex.open(self.uri, self.nprobe, self.use_gpu, query_chunk=self.query_chunk,
                                     keep_cpu=keep_cpu)
        if [_fingerprint(s) for s in manifest.shards] == [_fingerprint(s) for s in self.manifest.shards]:
            return self
        have = {_fingerprint(s.entry): s for s in self._loaded}
        loaded = [have.get(_fingerprint(e)) or _load_shard(self.uri, e, self.on_gpu, keep_cpu)
                  for e in manifest.shards]
        return ShardedIndex(self.uri, manifest, self._trained, loaded, self.on_gpu, self.nprobe,
                            self.query_chunk, keep_cpu, self.use_gpu)

    def columns_by_shard(self, columns: list[str], cache: dict) -> tuple[pa.Table, dict]:
        """``table(columns, missing_ok=True)``, reading only shards absent from ``cache`` (shard
        fingerprint -> its columns); returns the table and the cache of this index's shards."""
        fresh = {}
        for shard in self._loaded:
            key = (shard.entry.name, shard.entry.embeddings.sha256)  # removals do not change the columns
            fresh[key] = cache[key] if key in cache else read_columns(
                _path(self.uri, shard.entry.embeddings), columns, missing_ok=True)
        parts = list(fresh.values())
        return pa.concat_tables(parts, promote_options="permissive").combine_chunks(), fresh

    def reused_shards(self, other: ShardedIndex) -> int:
        """How many of this index's loaded shards are the very objects ``other`` holds (refresh tests)."""
        theirs = {id(s) for s in other._loaded}
        return sum(id(s) in theirs for s in self._loaded)

    @property
    def ntotal(self) -> int:
        """Rows (the length of ``live`` and of ``allowed`` masks), removed ones included."""
        return len(self._item_ids)

    @property
    def dim(self) -> int:
        return self.manifest.dim

    def search(self, queries: np.ndarray, k: int, nprobe: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k over all shards: queries (Q, E) -> scores (Q, k) float32, item ids (Q, k) str."""
        scores, ids = self.search_ids(queries, k, nprobe)
        return scores, self.to_item_ids(ids)

    def search_ids(self, queries: np.ndarray, k: int, nprobe: int | None = None,
                   allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k over all shards as global int64 ids: (Q, E) -> (Q, k) scores, (Q, k) ids.

        ``allowed``: bool (N,) over global ids; only those are returned (-1 pads when fewer than k).
        """
        q = self._check_queries(queries, k)
        selector = None
        if allowed is not None:
            selector = backend.id_selector(self._id_mask(self._check_allowed(allowed)))
        parts = [self._search_chunk(q[i:i + self.query_chunk], k, nprobe or self.nprobe, selector)
                 for i in range(0, len(q), self.query_chunk)]
        return np.concatenate([p[0] for p in parts]), self._to_rows(np.concatenate([p[1] for p in parts]))

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
        shards, coarse = (self._cpu_shards, self._cpu_coarse) if on_cpu else (self._shards, self._coarse)
        if self.manifest.nlist:  # IVF: every shard visits the same nprobe lists
            nprobe = min(nprobe, self.manifest.nlist)
            for shard in shards:
                if on_cpu:
                    self._ivf(shard).nprobe = nprobe
                else:
                    backend.set_nprobe(shard, nprobe, True)
        if coarse is None:
            results = [backend.search(shard, q, k, selector) for shard in shards]
        else:
            coarse_scores, lists = coarse.search(q, nprobe)  # (Q, nprobe) each, once for all shards
            results = [backend.search_preassigned(self._ivf(s), q, k, lists, coarse_scores, selector)
                       for s in shards]
        return merge_topk([r[0] for r in results], [r[1] for r in results], k, self.manifest.metric == "ip")

    def _ivf(self, shard: faiss.Index) -> faiss.IndexIVF:
        """The IVF view of a CPU shard, looked up once (a SWIG call per shard and query otherwise)."""
        ivf = self._ivfs.get(id(shard))
        if ivf is None:
            ivf = self._ivfs[id(shard)] = backend.ivf_of(shard)
        return ivf

    def _check_allowed(self, allowed: np.ndarray) -> np.ndarray:
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

    def to_item_ids(self, ids: np.ndarray) -> np.ndarray:
        """Rows (any shape, -1 for none) -> item ids (same shape, '' for none or removed)."""
        flat = np.asarray(ids, dtype=np.int64).ravel()
        names = np.array(self._item_ids.take(pa.array(np.maximum(flat, 0))).to_pylist(), dtype=object)
        names[(flat < 0) | (names == None)] = ""  # noqa: E711 - element-wise
        return names.reshape(np.shape(ids))

    def lookup(self, item_ids: list[str] | np.ndarray) -> np.ndarray:
        """Item ids -> rows (int64); raises IndexInputError naming any that are not indexed (or removed)."""
        wanted = pa.array([str(x) for x in item_ids], type=self._item_ids.type)
        found = pc.index_in(wanted, value_set=self._item_ids)
        if found.null_count:
            missing = [str(x) for x in wanted.filter(found.is_null()).to_pylist()[:10]]
            raise IndexInputError(f"{found.null_count} item id(s) are not in index {self.uri}, "
                                  f"e.g. {missing}")
        return found.to_numpy().astype(np.int64)

    def embeddings(self, item_ids: list[str] | np.ndarray) -> np.ndarray:
        """Stored embeddings of indexed items (n,) -> (n, E) float32, read from the shards' Parquet."""
        return embedding_matrix(self.rows(self.lookup(item_ids), [ITEM_ID, EMBEDDING]))

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
                          nprobe: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k neighbours of indexed items (their stored embeddings), without the item itself."""
        own = self.lookup(item_ids)  # (n,)
        most = self.max_k() - int(exclude_self)
        if not 1 <= k <= most:
            own_item = "the query item left out" if exclude_self else "the query item included"
            raise IndexInputError(f"k must be in [1, {most}] for this index ({own_item}), got {k}")
        scores, ids = self.search_ids(self.embeddings(item_ids), k + int(exclude_self), nprobe)
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
    return storage.join(uri, *entry.path.split("/"))


def _read_checked(uri: str, entry: FileEntry) -> bytes:
    return read_checked(uri, entry)


def _fingerprint(shard: ShardEntry) -> tuple:
    removed = shard.removed.sha256 if shard.removed else ""
    return shard.name, shard.index.sha256, shard.embeddings.sha256, shard.id_start, shard.count, removed


@dataclass
class LoadedShard:
    """One shard in memory: its FAISS index (removed ids taken out), the CPU copy, its rows' item ids."""

    entry: ShardEntry
    index: faiss.Index
    cpu_index: faiss.Index
    item_ids: pa.Array  # (count,) null where removed
    on_gpu: bool


def _load_shard(uri: str, entry: ShardEntry, use_gpu: bool, keep_cpu: bool) -> LoadedShard:
    """A shard's index (checksum checked), less its removed ids, on the search device."""
    cpu_index = backend.deserialize(_read_checked(uri, entry.index))
    item_ids = _load_item_ids(uri, entry)
    removed = removed_ids(uri, entry)  # (R,) global ids
    if len(removed):
        cpu_index.remove_ids(removed)
        live = pa.array(live_rows(uri, entry, removed))  # the removed-ids file is read once
        item_ids = pc.if_else(live, item_ids, pa.nulls(entry.count, item_ids.type))
    index, on_gpu = backend.to_search_device(cpu_index, use_gpu)
    return LoadedShard(entry, index, cpu_index if keep_cpu or not on_gpu else None, item_ids, on_gpu)


def _load_item_ids(uri: str, shard: ShardEntry) -> pa.Array:
    """Item id of every row of the shard, in row order."""
    col = read_columns(_path(uri, shard.embeddings), [ITEM_ID])[ITEM_ID]
    if len(col) != shard.count:
        raise IndexIntegrityError(f"{shard.name}: {len(col)} Parquet rows; manifest says {shard.count}")
    return col.combine_chunks()


def _concat(arrays: list[pa.Array]) -> pa.Array:
    if not arrays:
        return pa.array([], pa.string())
    return pa.chunked_array(arrays, type=arrays[0].type).combine_chunks()
