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
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from puma import storage
from puma.index import backend
from puma.index.manifest import FileEntry, IndexIntegrityError, Manifest, ShardEntry, read_manifest
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
    """The committed shards of one index, searched together (``ShardedIndex.open(uri)``)."""

    def __init__(self, uri: str, manifest: Manifest, trained: faiss.Index, shards: list[faiss.Index],
                 item_ids: pa.Array, on_gpu: bool, nprobe: int, query_chunk: int = 65536,
                 cpu_shards: list[faiss.Index] | None = None, use_gpu: bool = False) -> None:
        self.uri, self.manifest, self.on_gpu = uri, manifest, on_gpu
        self.nprobe, self.query_chunk, self.use_gpu = nprobe, query_chunk, use_gpu
        self._trained = trained  # owns the shared coarse quantizer
        ivf = backend.ivf_of(trained)
        self._cpu_coarse = ivf.quantizer if ivf is not None else None  # preassigned search on CPU
        self._coarse = None if on_gpu else self._cpu_coarse
        self._shards = shards
        self._cpu_shards = shards if not on_gpu else cpu_shards  # for selector searches
        self._item_ids = item_ids  # (N,) item id of each global id
        self._starts = np.array([s.id_start for s in manifest.shards], dtype=np.int64)

    @classmethod
    def open(cls, uri: str, nprobe: int = 16, use_gpu: bool = True, check: bool = False,
             query_chunk: int = 65536, keep_cpu: bool = False) -> ShardedIndex:
        """Load every committed shard (checksums checked as loaded; ``check`` runs a full verify).

        ``keep_cpu``: on GPU, also keep the CPU shards for restricted (``allowed``) searches.
        """
        if check:
            verify(uri).raise_if_bad()
        manifest = read_manifest(uri)
        if not manifest.shards:
            raise IndexInputError(f"index {uri} has no shards yet; add items before searching")
        trained = backend.deserialize(_read_checked(uri, manifest.trained))
        shards, cpu_shards, on_gpu = _load_shards(uri, manifest.shards, use_gpu, keep_cpu)
        return cls(uri, manifest, trained, shards, _load_item_ids(uri, manifest.shards), on_gpu, nprobe,
                   query_chunk, cpu_shards if keep_cpu else None, use_gpu)

    def refreshed(self, manifest: Manifest | None = None) -> ShardedIndex:
        """This index with the shards committed since it was opened, loading only those (itself when
        there are none). A manifest that does not extend this one (another trained index, a changed
        or removed shard: a rebuild) opens the index anew."""
        manifest = manifest or read_manifest(self.uri)
        if not self.extended_by(manifest):
            return ShardedIndex.open(self.uri, self.nprobe, self.use_gpu, query_chunk=self.query_chunk,
                                     keep_cpu=self._cpu_shards is not None)
        new = manifest.shards[len(self.manifest.shards):]
        if not new:
            return self
        shards, cpu_shards, _ = _load_shards(self.uri, new, self.on_gpu, self._cpu_shards is not None)
        item_ids = pa.chunked_array([self._item_ids, _load_item_ids(self.uri, new)]).combine_chunks()
        keep_cpu = self._cpu_shards is not None
        return ShardedIndex(self.uri, manifest, self._trained, self._shards + shards, item_ids, self.on_gpu,
                            self.nprobe, self.query_chunk,
                            (self._cpu_shards + cpu_shards) if keep_cpu else None, self.use_gpu)

    def extended_by(self, manifest: Manifest) -> bool:
        """Whether ``manifest`` holds this index's trained index and shards, unchanged, first."""
        old = self.manifest.shards
        if manifest.trained.sha256 != self.manifest.trained.sha256 or len(manifest.shards) < len(old):
            return False
        kept = manifest.shards[:len(old)]
        return all(_fingerprint(a) == _fingerprint(b) for a, b in zip(old, kept, strict=True))

    @property
    def ntotal(self) -> int:
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
        selector = None if allowed is None else backend.id_selector(self._check_allowed(allowed))
        parts = [self._search_chunk(q[i:i + self.query_chunk], k, nprobe or self.nprobe, selector)
                 for i in range(0, len(q), self.query_chunk)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def _search_chunk(self, q: np.ndarray, k: int, nprobe: int,
                      selector: faiss.IDSelector | None = None) -> tuple[np.ndarray, np.ndarray]:
        on_cpu = not self.on_gpu or selector is not None or k > backend.GPU_MAX_K
        shards, coarse = (self._cpu_shards, self._cpu_coarse) if on_cpu else (self._shards, self._coarse)
        if self.manifest.nlist:  # IVF: every shard visits the same nprobe lists
            nprobe = min(nprobe, self.manifest.nlist)
            for shard in shards:
                backend.set_nprobe(shard, nprobe, not on_cpu)
        if coarse is None:
            results = [backend.search(shard, q, k, selector) for shard in shards]
        else:
            coarse_scores, lists = coarse.search(q, nprobe)  # (Q, nprobe) each, once for all shards
            results = [backend.search_preassigned(backend.ivf_of(s), q, k, lists, coarse_scores, selector)
                       for s in shards]
        return merge_topk([r[0] for r in results], [r[1] for r in results], k, self.manifest.metric == "ip")

    def _check_allowed(self, allowed: np.ndarray) -> np.ndarray:
        mask = np.asarray(allowed)
        if mask.shape != (self.ntotal,) or mask.dtype != bool:
            raise IndexInputError(f"allowed must be a bool mask of shape ({self.ntotal},) over global ids, "
                                  f"got {mask.dtype} {mask.shape}")
        if self._cpu_shards is None:
            raise IndexInputError("FAISS GPU indexes ignore ID selectors: open the index with keep_cpu=True "
                                  "(or use_gpu=False) to search a subset of its items")
        return mask

    def max_k(self) -> int:
        """The most neighbours one search returns: every item, or FAISS GPU's limit on a GPU-only index."""
        gpu_only = self.on_gpu and self._cpu_shards is None
        return min(self.ntotal, backend.GPU_MAX_K) if gpu_only else self.ntotal

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
        """Global ids (any shape, -1 for none) -> item ids (same shape, '' for none)."""
        flat = np.asarray(ids, dtype=np.int64).ravel()
        names = np.array(self._item_ids.take(pa.array(np.maximum(flat, 0))).to_pylist(), dtype=object)
        names[flat < 0] = ""
        return names.reshape(np.shape(ids))

    def lookup(self, item_ids: list[str] | np.ndarray) -> np.ndarray:
        """Item ids -> global int64 ids; raises IndexInputError naming any that are not indexed."""
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
        """Stored columns of items by global id (n,), in that order; a column a shard lacks is null."""
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids):
            return pa.table({name: pa.nulls(0) for name in columns})
        shard_of = np.searchsorted(self._starts, ids, side="right") - 1  # (n,)
        parts, order = [], []
        for s in np.unique(shard_of):
            rows = np.flatnonzero(shard_of == s)
            entry = self.manifest.shards[s]
            part = read_rows(_path(self.uri, entry.embeddings), ids[rows] - entry.id_start, columns,
                             missing_ok=True)
            parts.append(part)
            order.append(rows)
        table = pa.concat_tables(parts, promote_options="permissive")
        return table.take(pa.array(np.argsort(np.concatenate(order), kind="stable")))

    def table(self, columns: list[str], missing_ok: bool = False) -> pa.Table:
        """Stored columns of every item in global id order (``missing_ok``: absent columns are null)."""
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
    """A file's bytes, refused when they do not match the manifest's sha256."""
    data = storage.read_bytes(_path(uri, entry))
    if storage.sha256(data) != entry.sha256:
        raise IndexIntegrityError(f"{_path(uri, entry)} does not match its manifest checksum; run "
                                  f"puma.index.verify({uri!r}) and rebuild the damaged shard")
    return data


def _fingerprint(shard: ShardEntry) -> tuple[str, str, str, int, int]:
    return shard.name, shard.index.sha256, shard.embeddings.sha256, shard.id_start, shard.count


def _load_shards(uri: str, entries: list[ShardEntry], use_gpu: bool,
                 keep_cpu: bool) -> tuple[list[faiss.Index], list[faiss.Index], bool]:
    """(search shards, their CPU copies when ``keep_cpu``, on GPU?) of the given shard entries."""
    shards, cpu_shards, on_gpu = [], [], False
    for shard in entries:
        cpu_index = backend.deserialize(_read_checked(uri, shard.index))
        index, on_gpu = backend.to_search_device(cpu_index, use_gpu)
        shards.append(index)
        if keep_cpu:
            cpu_shards.append(cpu_index)
    return shards, cpu_shards, on_gpu


def _load_item_ids(uri: str, entries: list[ShardEntry]) -> pa.Array:
    """Item id of every global id of the given shards, concatenated in shard order (ids are contiguous)."""
    parts = []
    for shard in entries:
        col = read_columns(_path(uri, shard.embeddings), [ITEM_ID])[ITEM_ID]
        if len(col) != shard.count:
            raise IndexIntegrityError(f"{shard.name}: {len(col)} Parquet rows; manifest says {shard.count}")
        parts.extend(col.chunks)
    return pa.chunked_array(parts).combine_chunks()
