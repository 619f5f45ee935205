"""The index as the service sees it: searched by vector or item id, filtered by dataset, catalogue or
metadata (puma.serve.selection), its hits described from the stored columns, and kept current as
embedding jobs commit.

No Ray here: an index replica (puma.serve.holders) holds one ServedIndexes (puma.serve.versions: the
versions the location's alias names) and refreshes it on a timer. Each version is a ``LiveIndex``: a
refresh reads its manifest (one small file); when it changed, only the shards that are new or whose
removals changed are loaded (``ShardedIndex.refreshed``) and the new state replaces the old in one
assignment, so a request in flight finishes on the state it started with.

Hits carry item_id, score, dataset, label, class_name, catalogue, image_uri, image_row and the
item's metadata (a catalogue table's other columns), in rank order.

Memory at millions of items (a replica holds the FAISS shards plus a small, stated cost per item): each
shard's hit columns and embeddings are written once to an Arrow IPC file in the LiveIndex's local cache
folder (index.cache_dir; puma.index.cache), and a query reads only its k hits' fields (and an item
query its item's vector) from it, with positioned reads: the file is page cache, not process memory.
In memory per item: the item-id hash lookup (12 bytes), the live flag (1 byte), the dataset and
catalogue columns for filters and stats (dictionary-encoded: 1 byte each with fewer than 128 names),
and per cached filter one bit. With index.on_disk the IVF lists are memory-mapped from the same folder
(FAISS on-disk inverted lists; identical results).
"""

from __future__ import annotations

import functools
import io
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
from PIL import Image

from puma.config import IndexConfig
from puma.data.images import ImageRejected, decode_image
from puma.index.cache import LocalCache
from puma.index.filters import Filter, FilterError
from puma.index.manifest import Manifest, read_manifest
from puma.index.plan import IndexInputError
from puma.index.search import Holding, Selection, ShardedIndex, drop_self
from puma.index.table import (
    CATALOGUE,
    CLASS_NAME,
    DATASET,
    EMBEDDING,
    IMAGE_ROW,
    IMAGE_URI,
    ITEM_ID,
    LABEL,
    METADATA,
)
from puma.inference.embedder import read_image_bytes
from puma.serve.answers import HIT_COLUMNS, hits, part_answer
from puma.serve.errors import RequestError
from puma.serve.partitions import Partition, index_bytes
from puma.serve.requests import filter_option
from puma.serve.selection import (
    catalogue_mask,
    catalogue_names,
    catalogue_short_name,
    column_mask,
    filter_mask,
    first_look,
    live_counts,
    named_filters,
    range_match,
)

log = logging.getLogger(__name__)
_NAMES = pa.dictionary(pa.int32(), pa.string())  # few distinct values, stored once; codes narrowed to fit
HIT_SCHEMA = pa.schema([(ITEM_ID, pa.string()), (DATASET, _NAMES), (LABEL, pa.int32()), (CLASS_NAME, _NAMES),
                        (CATALOGUE, _NAMES), (IMAGE_URI, pa.string()), (IMAGE_ROW, pa.int32()),
                        (METADATA, pa.string())])  # int32 where the values fit (else kept int64)
FILTER_COLUMNS = (DATASET, CATALOGUE)  # in memory: filters and stats evaluate them on every item
ROW_COLUMNS = tuple(c for c in (*HIT_COLUMNS, EMBEDDING) if c not in FILTER_COLUMNS)  # read per hit
THUMBNAIL_SIDE = 256
MAX_CACHED_FILTERS = 64  # filters whose selections (one bit per item each) a state keeps


@dataclass
class State:
    """One loaded version of the index: searched by requests while a newer one may be loading."""

    index: ShardedIndex | None  # None while the index has no shards
    manifest: Manifest
    loaded_at: float = field(default_factory=time.time)
    selections: dict = field(default_factory=dict)  # (datasets, catalogues, filter) -> (Selection, unknowns)
    shares: dict = field(default_factory=dict)  # filter -> the share of live items it keeps, once counted
    selection_bytes: int = 0  # what the selections hold of gathered embeddings (index.filter_cache_mb)
    filterable: dict | None = None  # GET /stats' filterable columns, described once per state

    @property
    def items(self) -> int:
        return 0 if self.index is None else self.index.live_total


class LiveIndex:
    """One index folder (a version of the location, or a location without versions), refreshed from
    its manifest; refuses a manifest of another model id or dimension."""

    def __init__(self, cfg: IndexConfig, model_id: str | None, dim: int, uri: str = "",
                 version: str = "", partition: Partition = Partition()) -> None:
        self.cfg, self.dim, self.version, self.partition = cfg, dim, version, partition
        self.uri = uri or cfg.uri
        self.refused = ""  # why the newest manifest is not served ('' when it is)
        self._lock = threading.Lock()  # one refresh at a time
        self._cache = LocalCache(cfg.cache_dir)  # this index's memory-mapped files
        manifest = read_manifest(self.uri)
        self.model_id = manifest.model_id if model_id is None else model_id
        self.state = self._load(self._checked(partition.of(manifest)), None)

    # ------------------------------------------------------------------------- refreshing

    def refresh(self) -> bool:
        """Load what was committed since the last load; True when the served index changed."""
        with self._lock:
            manifest = self.partition.of(read_manifest(self.uri))
            if _version(manifest) == _version(self.state.manifest):
                return False
            try:
                manifest = self._checked(manifest)
            except IndexInputError as exc:
                if str(exc) != self.refused:
                    log.error("not serving the new manifest of %s: %s", self.uri, exc)
                self.refused = str(exc)
                return False
            self.state, self.refused = self._load(manifest, self.state), ""
            log.info("serving %s (%s): %d items in %d shards", self.uri, self.partition.describe(),
                     self.state.items, len(manifest.shards))
            return True

    def _checked(self, manifest: Manifest) -> Manifest:
        """The manifest, if it holds embeddings of the served model and dimension."""
        if manifest.model_id != self.model_id:
            raise IndexInputError(f"index {self.uri} now holds embeddings of model "
                                  f"{manifest.model_id or '(none recorded)'!r}, not of the served model "
                                  f"{self.model_id or '(none recorded)'!r}; restart the service with that "
                                  "model's checkpoint, or point index.uri at an index of this model")
        if manifest.dim != self.dim:
            raise IndexInputError(f"index {self.uri} now holds {manifest.dim}-dim embeddings; the "
                                  f"service serves {self.dim}-dim ones")
        return manifest

    def _load(self, manifest: Manifest, old: State | None) -> State:
        """A state for ``manifest``, reusing the shards (and their columns) ``old`` already holds."""
        if not manifest.shards:
            return State(None, manifest)
        if old is None or old.index is None or old.index.manifest.trained.sha256 != manifest.trained.sha256:
            holding = Holding(FILTER_COLUMNS, ROW_COLUMNS, HIT_SCHEMA, self._cache,
                              lists_on_disk=self._lists_on_disk(manifest), filters=True)
            index = ShardedIndex.open(self.uri, nprobe=self.cfg.nprobe, use_gpu=self.cfg.use_gpu,
                                      query_chunk=self.cfg.query_chunk, keep_cpu=True, manifest=manifest,
                                      holding=holding)
        else:
            index = old.index.refreshed(manifest)
        self._cache.keep(index.cache_files())  # a request on an older state keeps its mappings
        return State(index, manifest)

    def _lists_on_disk(self, manifest: Manifest) -> bool:
        """index.on_disk: always, never, or auto: when the index (partition) is estimated above
        index.memory_budget_gb (jobs/serve.py resolves auto from serve.index_replica_memory_gb)."""
        if self.cfg.on_disk != "auto":
            return self.cfg.on_disk == "always"
        return index_bytes(manifest) > self.cfg.memory_budget_gb * 1e9

    # ------------------------------------------------------------------------- searching

    def search_vector(self, vector: np.ndarray, k: int, datasets: tuple[str, ...] = (),
                      catalogues: tuple[str, ...] = (), where: Filter | None = None) -> list[dict]:
        """Hits of one query embedding (E,), best first, among the items ``where`` selects (a metadata
        filter, puma.index.filters); 422 when the vector has the wrong length or the filter cannot apply."""
        state = self._searchable()
        self.check_vector(vector)
        scores, ids, _ = self._search(state, vector[None, :], min(k, state.items), datasets, catalogues,
                                      filter_option(where))
        return hits(state.index, scores[0], ids[0])

    def search_part(self, vector: np.ndarray, k: int, datasets: tuple[str, ...] = (),
                    catalogues: tuple[str, ...] = (), where: Filter | dict | None = None) -> dict:
        """One partition's answer to a query (puma.serve.partitions): its top-k hits carrying their
        merge order, its live items, and the filter names it does not know (no 4xx here: another
        partition may hold them; the ingress refuses names no partition knows)."""
        self.check_vector(vector)
        state = self.state
        if state.index is None or not state.items:
            columns = sorted(where.columns()) if where is not None else []
            return {"hits": [], "items": 0, "unknown": named_filters(datasets, catalogues, columns)}
        scores, ids, unknown = self._search(state, vector[None, :], min(k, state.items), datasets, catalogues,
                                            filter_option(where), strict=False)
        return part_answer(state.index, scores[0], ids[0], unknown)

    def search_parts(self, vectors: list[np.ndarray], k: int) -> list[dict]:
        """``search_part`` of many unfiltered queries at once: one FAISS call for the batch (Q, E)."""
        for vector in vectors:
            self.check_vector(vector)
        state = self.state
        if state.index is None or not state.items:
            return [{"hits": [], "items": 0, "unknown": []} for _ in vectors]
        scores, ids = state.index.search_ids(np.stack(vectors), min(k, state.items))  # (Q, k)
        return [part_answer(state.index, s, i, []) for s, i in zip(scores, ids, strict=True)]

    def holds(self, item_id: str) -> bool:
        """Whether this index (partition) holds the live item ``item_id``."""
        return self._holder(item_id) is not None

    def vector_of(self, item_id: str) -> np.ndarray | None:
        """An indexed item's stored embedding (E,), None when this index (partition) does not hold it."""
        state = self.state  # one state for the check and the read: a refresh may come between
        row = self._row(state, item_id)
        return None if row < 0 else state.index.vector(row)

    def _holder(self, item_id: str) -> State | None:
        """The served state if it holds the live item ``item_id``, else None."""
        state = self.state
        return state if self._row(state, item_id) >= 0 else None

    @staticmethod
    def _row(state: State, item_id: str) -> int:
        """The live row of ``item_id`` in ``state``, -1 when it holds no such item."""
        if state.index is None or not state.items:
            return -1
        return state.index.find(str(item_id))

    def check_vector(self, vector: np.ndarray) -> None:
        if vector.shape != (self.dim,):
            raise RequestError(422, f"vector has {vector.size} values; the index holds {self.dim}-dim "
                                    "embeddings")

    def search_vectors(self, vectors: list[np.ndarray], k: int) -> list[list[dict]]:
        """Hits of many query embeddings at once (no filters): one FAISS call for the whole batch."""
        state = self._searchable()
        scores, ids = state.index.search_ids(np.stack(vectors), min(k, state.items))  # (Q, k)
        return [hits(state.index, s, i) for s, i in zip(scores, ids, strict=True)]

    def search_item(self, item_id: str, k: int, datasets: tuple[str, ...] = (),
                    catalogues: tuple[str, ...] = (), include_self: bool = False,
                    where: Filter | None = None) -> list[dict]:
        """Hits of an indexed item's stored embedding (the item itself left out unless include_self)."""
        state = self._searchable()
        own = self._lookup(state, item_id)  # (1,)
        vector = state.index.vector(int(own[0]))[None, :]  # (1, E)
        extra = 0 if include_self else 1
        scores, ids, _ = self._search(state, vector, min(k + extra, state.items), datasets, catalogues,
                                      filter_option(where))
        if extra and ids.shape[1] > 0:
            scores, ids = drop_self(scores, ids, own)
        return hits(state.index, scores[0][:k], ids[0][:k])

    def _searchable(self) -> State:
        state = self.state
        if state.index is None or not state.items:
            raise RequestError(503, f"index {self.uri} has no items yet; embed a catalogue with "
                                    "jobs/embed.py (the service picks it up without a restart)")
        return state

    def _lookup(self, state: State, item_id: str) -> np.ndarray:
        """(1,) the live row of ``item_id``; 404 when the index does not hold it."""
        row = self._row(state, item_id)
        if row < 0:
            raise RequestError(404, f"unknown item id {item_id!r}: it is not in the index")
        return np.array([row], dtype=np.int64)

    def _search(self, state: State, q: np.ndarray, k: int, datasets: tuple[str, ...],
                catalogues: tuple[str, ...], where: Filter | None,
                strict: bool = True) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """Top-k rows (Q, k) of queries (Q, E) among the items selected, and the names no item has (see
        ``_allowed``). A broad metadata filter is evaluated on the hits of an unfiltered search instead
        (``ShardedIndex.search_post_filtered``) where that answers: the same hits, sooner than with its
        selection, even a cached one (made when too few hits passed for another query)."""
        mask = rows = None
        if where is not None and not datasets and not catalogues and \
                where.columns() <= state.index.filter_types.keys():
            share = state.shares.get(where.key)  # counted already: its hits are evaluated on their own
            if share is None:  # found once (selection.first_look): its share, then its hits or selection
                share, mask, rows = first_look(state.index, where, strict)
                _remember(state.shares, where.key, share)
            try:
                found = state.index.search_post_filtered(q, k, where, share=share, mask=mask)
            except FilterError as exc:
                raise RequestError(422, str(exc)) from exc
            if found is not None:
                return *found, []
        allowed, unknown = self._allowed(state, datasets, catalogues, where, strict, mask, rows)
        return *state.index.search_ids(q, k, allowed=allowed), unknown

    def _allowed(self, state: State, datasets: tuple[str, ...], catalogues: tuple[str, ...],
                 where: Filter | None = None, strict: bool = True, mask: np.ndarray | None = None,
                 rows: np.ndarray | None = None) -> tuple[Selection | None, list[str]]:
        """The items in the named datasets and catalogues that ``where`` selects (None: no filter;
        ``mask`` or ``rows``: them, where already found), selected for FAISS once per filter and state, and
        the names no live item has: a 422 naming them when ``strict``, else returned (they match
        nothing). A selection scanned exactly holds its rows' embeddings from its second use on."""
        if not datasets and not catalogues and where is None:
            return None, []
        key = (datasets, catalogues, where.key if where is not None else "")
        if key not in state.selections:
            if len(state.selections) >= MAX_CACHED_FILTERS:
                state.selections.clear()
                state.selection_bytes = 0
            if rows is None and mask is None and not datasets and not catalogues:
                rows = range_match(state.index, where)[0]
            if rows is not None:  # a narrow number range's rows (no dataset or catalogue named)
                state.selections[key] = (state.index.select_rows(rows), [], [], [])
            else:
                live = state.index.live
                by_dataset, unknown_datasets = column_mask(state.index, DATASET, datasets, live)
                by_catalogue, unknown_catalogues = catalogue_mask(state.index, catalogues, live)
                by_filter, unknown_columns = (mask, []) if mask is not None else \
                    filter_mask(state.index, where, strict)
                masks = [m for m in (by_dataset, by_catalogue, by_filter) if m is not None]
                chosen = state.index.select(functools.reduce(np.logical_and, masks, live))
                state.selections[key] = (chosen, unknown_datasets, unknown_catalogues, unknown_columns)
        else:  # a repeated filter
            state.selections[key] = (self._held(state, state.selections[key][0]), *state.selections[key][1:])
        chosen, unknown_datasets, unknown_catalogues, unknown_columns = state.selections[key]
        if strict and unknown_datasets:
            present = live_counts(state.index, DATASET)
            raise RequestError(422, f"unknown dataset(s) {unknown_datasets}; this index has "
                                    f"{sorted(present)[:20]}")
        if strict and unknown_catalogues:
            present = catalogue_names(state.index)
            raise RequestError(422, f"unknown catalogue(s) {unknown_catalogues}; this index has "
                                    f"{sorted(present)[:20]}")
        return chosen, named_filters(unknown_datasets, unknown_catalogues, unknown_columns)

    def _held(self, state: State, chosen: Selection) -> Selection:
        """A repeated filter's selection scanned exactly, with its rows' embeddings gathered now while
        the state's selections hold at most index.filter_cache_mb of them: its scans then read one
        contiguous block (a filter used once gathers only the rows its scan ranks)."""
        if chosen.rows is None or chosen.vectors is not None:
            return chosen
        need = len(chosen.rows) * state.index.dim * 4  # float32
        if state.selection_bytes + need > self.cfg.filter_cache_mb * 1e6:
            return chosen
        state.selection_bytes += need
        return state.index.with_vectors(chosen)

    # ------------------------------------------------------------------------- images and stats

    def thumbnail(self, item_id: str) -> bytes:
        """A JPEG of at most THUMBNAIL_SIDE px of an indexed item's stored image; 404 when there is none."""
        state = self._searchable()
        row = state.index.describe(self._lookup(state, item_id), [IMAGE_URI, IMAGE_ROW])[0]
        if not row[IMAGE_URI]:
            raise RequestError(404, f"item {item_id!r} has no stored image location")
        image_row = -1 if row[IMAGE_ROW] is None else int(row[IMAGE_ROW])
        data = read_image_bytes(pa.table({IMAGE_URI: [row[IMAGE_URI]], IMAGE_ROW: [image_row]}))[0]
        if isinstance(data, Exception):
            raise RequestError(404, f"the image of item {item_id!r} cannot be read: {data}")
        try:
            img = decode_image(bytes(data), min_size=1)
        except ImageRejected as exc:
            raise RequestError(404, f"the image of item {item_id!r} cannot be decoded: {exc}") from exc
        img.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE), Image.Resampling.BICUBIC)
        out = io.BytesIO()
        img.save(out, format="JPEG", quality=85)
        return out.getvalue()

    def stats(self) -> dict:
        """Items, shards, datasets and catalogues with their counts, the model id, freshness."""
        state, manifest = self.state, self.state.manifest
        datasets = {} if state.index is None else live_counts(state.index, DATASET)
        catalogues = {} if state.index is None else live_counts(state.index, CATALOGUE)
        return {"index_uri": self.uri, "version": self.version, "items": state.items,
                "shards": len(manifest.shards), "removed_rows": manifest.removed,
                "model_id": manifest.model_id, "dim": manifest.dim, "metric": manifest.metric,
                "index_type": manifest.index_type, "nprobe": self.cfg.nprobe,
                "on_gpu": bool(state.index is not None and state.index.on_gpu),
                "datasets": datasets,
                "catalogues": [{"uri": uri, "name": catalogue_short_name(uri), "items": n}
                               for uri, n in catalogues.items()],
                "filterable": _filterable(state),
                "manifest_updated": manifest.updated, "loaded_at": time.strftime(
                    "%Y-%m-%dT%H:%M:%SZ", time.gmtime(state.loaded_at)), "refused_update": self.refused}


def _remember(cache: dict, key: str, value: float) -> float:
    """``value`` stored under ``key`` in a cache of at most MAX_CACHED_FILTERS entries (cleared when
    full, as the selections are)."""
    if len(cache) >= MAX_CACHED_FILTERS:
        cache.clear()
    cache[key] = value
    return value


def _version(manifest: Manifest) -> tuple:
    """What identifies a committed manifest: its trained index, model, shards with their removals."""
    return (manifest.trained.sha256, manifest.model_id,
            tuple((s.name, s.index.sha256, s.removed.sha256 if s.removed else "") for s in manifest.shards))


def _filterable(state: State) -> dict:
    """The columns a filter may name: their types and, for text columns with few values, the values."""
    if state.filterable is None:
        state.filterable = {} if state.index is None else state.index.describe_filters()
    return state.filterable
