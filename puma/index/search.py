"""Search every shard of an index and merge their top-k into the global top-k.

IVF shards share one trained coarse quantizer, so on CPU the queries are assigned to their
``nprobe`` nearest lists once and those lists of every shard are scanned in one call, through one IVF
index whose lists stack the shards' lists in place (``backend.stacked_lists``); the result equals
searching one IVF index holding all the vectors. A restricted search, which visits many more lists,
scans them shard by shard instead (the stacked lists copy every list they visit). On GPU each shard
is searched whole. Flat shards are exact, so the merged result equals one exact index over all
vectors.

Missing results (fewer than k candidates in the probed lists) come back as id -1 / item id ''
with score -inf (ip) or +inf (l2).

``allowed`` (a bool mask over global ids) restricts a search to some items through FAISS ID
selectors, e.g. one dataset's gallery in evaluation. FAISS GPU indexes ignore selectors, so an
index opened on GPU with ``keep_cpu=True`` runs restricted searches (and k above the GPU limit) on
its CPU copies; without them such a search is refused.

Loading and holding the shards is ``puma.index.loaded``'s business; their rows (item ids, stored
columns, metadata filters) ``puma.index.rows``'.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from puma.index import backend, filtered
from puma.index.filtered import brute_force, exact_topk, filtered_nprobe, near_rows, ranked_topk
from puma.index.loaded import Holding, LoadedShard, fingerprint, load_shards
from puma.index.manifest import Manifest, read_checked, read_manifest
from puma.index.plan import IndexInputError
from puma.index.rows import IndexRows
from puma.index.verify import verify

if TYPE_CHECKING:
    import faiss

    from puma.index.filters import Filter

__all__ = ["Holding", "IndexInputError", "LoadedShard", "Selection", "ShardedIndex", "drop_self",
           "merge_topk"]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Selection:
    """Rows a restricted search may return, as FAISS wants them: a bitmap over global ids."""

    bits: np.ndarray  # (ceil(size/8),) uint8, little-endian bit order (empty when ``rows`` is set)
    size: int  # global ids covered
    count: int = -1  # rows selected (-1: not counted); an IVF search looks further the fewer there are
    rows: np.ndarray | None = None  # the selected rows, ascending, when few enough to scan exactly
    vectors: np.ndarray | None = None  # their embeddings (rows, E), gathered once for a repeated filter


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


class ShardedIndex(IndexRows):
    """The committed shards of one index, searched together (``ShardedIndex.open(uri)``).

    Rows: the shards' Parquet rows concatenated in shard order, 0..ntotal-1. Search results, item
    lookups, ``allowed`` masks and ``rows`` speak rows, which equal the FAISS global ids until a
    compaction leaves a gap in the ids. Removed (tombstoned) rows stay as rows with a null item id,
    are taken out of the FAISS shards as they load, and are never returned (``live`` is False).
    """

    def __init__(self, uri: str, manifest: Manifest, trained: faiss.Index, loaded: list[LoadedShard],
                 on_gpu: bool, nprobe: int, query_chunk: int = 65536, keep_cpu: bool = False,
                 use_gpu: bool = False, holding: Holding = Holding()) -> None:
        super().__init__(uri, manifest, loaded, holding)
        self.on_gpu, self.nprobe, self.query_chunk, self.use_gpu = on_gpu, nprobe, query_chunk, use_gpu
        self._trained = trained  # owns the shared coarse quantizer
        ivf = backend.ivf_of(trained)
        self._cpu_coarse = ivf.quantizer if ivf is not None else None  # preassigned search on CPU
        self._coarse = None if on_gpu else self._cpu_coarse
        self._ivfs: dict[int, faiss.IndexIVF] = {}  # id(CPU shard) -> its IVF view (_ivf)
        self._shards = [s.index for s in loaded]
        cpu_copies = [s.cpu_index for s in loaded] if keep_cpu else None
        self._cpu_shards = self._shards if not on_gpu else cpu_copies
        self._stacked, self._stacked_refs = None, None  # the CPU shards' IVF lists as one index
        if ivf is not None and self._cpu_shards:
            self._stacked, self._stacked_refs = backend.stacked_lists(trained, self._cpu_shards)

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
            trained = pool.submit(lambda: backend.deserialize(read_checked(uri, manifest.trained)))
            loaded = load_shards(uri, manifest.shards, use_gpu, keep_cpu, holding, {})
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
        if [fingerprint(s) for s in manifest.shards] == [fingerprint(s) for s in self.manifest.shards]:
            return self
        have = {fingerprint(s.entry): s for s in self._loaded}
        new = [e for e in manifest.shards if fingerprint(e) not in have]
        same_rows = {s.entry.embeddings.sha256: s for s in self._loaded}  # removals do not change rows
        fresh = {fingerprint(s.entry): s
                 for s in load_shards(self.uri, new, self.on_gpu, keep_cpu, self.holding, same_rows)}
        loaded = [have.get(fingerprint(e)) or fresh[fingerprint(e)] for e in manifest.shards]
        return ShardedIndex(self.uri, manifest, self._trained, loaded, self.on_gpu, self.nprobe,
                            self.query_chunk, keep_cpu, self.use_gpu, self.holding)

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
            return self._scan(q, k, nprobe, chosen)
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

    def _scan(self, q: np.ndarray, k: int, nprobe: int, chosen: Selection) -> tuple[np.ndarray, np.ndarray]:
        """The exact scan of a selection's rows; on IVF, of those in the nprobe / fraction lists nearest
        each query while that is fewer than every list (``puma.index.filtered.near_rows``). A selection
        holding its vectors (a repeated filter) is scanned whole."""
        metric, nlist = self.manifest.metric, self.manifest.nlist
        if chosen.vectors is not None:
            return exact_topk(chosen.vectors, chosen.rows, q, k, metric)
        lists = filtered_nprobe(nprobe, nlist, chosen.count, self.live_total) if nlist else 0
        if lists >= nlist or self._cpu_shards is None:
            return self._scan_rows(q, chosen.rows, k)
        row_lists = np.take(self._row_lists, chosen.rows)  # (n,)
        parts = []
        for query in q:
            near = backend.nearest_lists(self._cpu_coarse, query, lists)
            rows = np.compress(near_rows(row_lists, near, nlist), chosen.rows)
            part = self._scan_rows(query[None, :], rows, k)
            if (part[1] >= 0).sum() < min(k, len(chosen.rows)):  # too few near: every selected row
                part = self._scan_rows(query[None, :], chosen.rows, k)
            parts.append(part)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def _scan_rows(self, q: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The exact top-k of queries (Q, E) among rows (n,) ascending: one query scores them where they
        are stored (``scores_at``), more share one gathered copy of their vectors."""
        metric = self.manifest.metric
        if len(q) > 1:
            return exact_topk(self.vectors_at(rows), rows, q, k, metric)
        return ranked_topk(self.scores_at(q[0], rows, metric)[None, :], rows, q, k, metric,
                           lambda at: self.vectors_at(rows[at]))

    @cached_property
    def _row_lists(self) -> np.ndarray:
        """Each row's inverted list (-1: removed), from the loaded shards' (kept across refreshes)."""
        nlist = self.manifest.nlist
        return np.concatenate([s.row_lists(cpu, nlist) for s, cpu in zip(self._loaded, self._cpu_shards,
                                                                         strict=True)])

    def search_post_filtered(self, queries: np.ndarray, k: int, where: Filter, nprobe: int | None = None,
                             share: float | None = None,
                             mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """The top-k rows ``where`` selects, for a broad filter, without selecting: the filter evaluated
        on the hits of an unfiltered search over the lists the search with the selection would visit
        (``puma.index.filtered``); None when it keeps too few items for that, or too few hits passed
        (search with ``select`` then). ``share``: the live items it keeps, where already counted (its
        selection); else counted on ``mask``, its rows (``filter_mask``) where already evaluated, whose
        entries the hits are then looked up in; else estimated (``filter_share``)."""
        if share is None and mask is not None:
            share = np.count_nonzero(mask) / max(1, self.live_total)
        share = self.filter_share(where) if share is None else share
        if share < filtered.POST_FILTER_SHARE:
            return None
        wanted = min(self.live_total, math.ceil(filtered.POST_FILTER_MARGIN * k / share))
        nprobe, nlist = nprobe or self.nprobe, self.manifest.nlist
        if nlist:  # the lists the search with the selection would visit
            nprobe = filtered_nprobe(nprobe, nlist, round(share * self.live_total), self.live_total)
        scores, rows = self.search_ids(queries, wanted, nprobe)
        if mask is None:
            passed = self.filter_at(where, rows.ravel()).reshape(rows.shape)
        else:
            passed = (rows >= 0) & mask[np.maximum(rows, 0)]
        if (passed.sum(axis=1) < k).any():
            return None
        order = np.argsort(~passed, axis=1, kind="stable")[:, :k]  # the passing hits, best first
        return np.take_along_axis(scores, order, axis=1), np.take_along_axis(rows, order, axis=1)

    def _search_all(self, q: np.ndarray, k: int, nprobe: int,
                    selector: faiss.IDSelector | None) -> tuple[np.ndarray, np.ndarray]:
        parts = [self._search_chunk(q[i:i + self.query_chunk], k, nprobe, selector)
                 for i in range(0, len(q), self.query_chunk)]
        return np.concatenate([p[0] for p in parts]), self._to_rows(np.concatenate([p[1] for p in parts]))

    def select(self, allowed: np.ndarray) -> Selection:
        """A bool mask (N,) over rows as a restricted search's bitmap over FAISS global ids (N/8 bytes)."""
        rows_mask = self._check_allowed(allowed)
        size = self.ntotal if self._gapless else self.manifest.next_id
        count = int(np.count_nonzero(rows_mask))
        if brute_force(count, self.dim):  # scanned exactly: FAISS's bitmap is never needed
            return Selection(np.zeros(0, np.uint8), size, count, np.flatnonzero(rows_mask))
        return Selection(self._bitmap(rows_mask), size, count)

    def select_rows(self, rows: np.ndarray) -> Selection:
        """``select`` from the selected rows (ascending, live) instead of a mask."""
        size = self.ntotal if self._gapless else self.manifest.next_id
        chosen = Selection(np.zeros(0, np.uint8), size, len(rows), rows)
        if brute_force(len(rows), self.dim):
            return chosen
        return dataclasses.replace(chosen, bits=self._bits(chosen), rows=None)

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

    def _search_chunk(self, q: np.ndarray, k: int, nprobe: int,
                      selector: faiss.IDSelector | None = None) -> tuple[np.ndarray, np.ndarray]:
        on_cpu = not self.on_gpu or selector is not None or k > backend.GPU_MAX_K
        largest = self.manifest.metric == "ip"
        if on_cpu and self._stacked is not None and selector is None:  # IVF on CPU: one scan of every
            # shard's lists (the stacked lists copy each list they visit: a selector's many lists are
            # scanned shard by shard, half the time at nprobe / 5%)
            nprobe = min(nprobe, self.manifest.nlist)
            coarse_scores, lists = self._cpu_coarse.search(q, nprobe)  # (Q, nprobe) each
            scores, ids = backend.search_preassigned(self._stacked, q, k, lists, coarse_scores, selector)
            return merge_topk([scores], [ids], k, largest)  # pads: id -1, score -inf (ip) / +inf (l2)
        shards, coarse = (self._cpu_shards, self._cpu_coarse) if on_cpu else (self._shards, self._coarse)
        if self.manifest.nlist:  # IVF: every shard visits the same nprobe lists (on CPU the call says so)
            nprobe = min(nprobe, self.manifest.nlist)
            for shard in shards if not on_cpu else ():
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
