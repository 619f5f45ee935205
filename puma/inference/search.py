"""What ``jobs/search.py`` does: load queries, search the sharded index, write a results table.

Queries are stored vectors (a ``.npy`` (Q, E) float array, or an embeddings Parquet with item_id
and embedding), item ids already in the index (their stored embeddings, the item itself left
out), or image files embedded in-process with a checkpoint's model (puma.inference.query).
Results are one Parquet row per (query, rank): query, rank, item_id, score; optionally a
retrieval grid PNG (puma.inference.grid) of the queries and their results.

Image queries are embedded by a checkpoint: when the index records the id of the model that built
it, the checkpoint's id (``puma.checkpoint.checkpoint_id``, computed as the embed job computes it)
must equal it, else the results compare vectors of two different models and a warning says so.
"""

from __future__ import annotations

import io
import logging
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from puma import storage
from puma.config import IndexConfig
from puma.index.filters import Filter
from puma.index.manifest import Manifest
from puma.index.plan import IndexInputError
from puma.index.search import Holding, ShardedIndex
from puma.index.table import (
    CLASS_NAME,
    DATASET,
    IMAGE_ROW,
    IMAGE_URI,
    ITEM_ID,
    LABEL,
    METADATA,
    NO_LABEL,
    check_table,
    embedding_matrix,
    read_table,
    to_parquet_bytes,
)
from puma.inference.grid import GridItem, retrieval_grid, write_grid

log = logging.getLogger(__name__)
GRID_COLUMNS = [ITEM_ID, DATASET, LABEL, IMAGE_URI, IMAGE_ROW]


@dataclass
class SearchOutcome:
    """Where the results went and what they are."""

    out_uri: str
    results: pa.Table  # query, rank, item_id, score
    index_items: int
    index_shards: int
    grid_uri: str = ""  # the retrieval grid PNG, when one was asked for
    k: int = 0  # neighbours returned per query: the k asked for, or fewer when the index holds fewer
    k_limit: str = ""  # why k is smaller than asked ('' when it is not)


def load_queries(uri: str) -> tuple[list[str], np.ndarray]:
    """Query names and vectors (Q, E) from a .npy array or an embeddings Parquet."""
    if str(uri).endswith(".npy"):
        x = np.load(io.BytesIO(storage.read_bytes(uri)), allow_pickle=False)
        if x.ndim != 2:
            raise IndexInputError(f"{uri}: expected a (Q, E) array, got shape {x.shape}")
        return [f"q{i}" for i in range(len(x))], x
    table = check_table(read_table(uri))
    return [str(s) for s in table[ITEM_ID].to_pylist()], embedding_matrix(table)


HIT_COLUMNS = [DATASET, LABEL, CLASS_NAME, METADATA]  # what each result row carries beside its item id


def results_table(queries: list[str], scores: np.ndarray, item_ids: np.ndarray,
                  index: ShardedIndex | None = None) -> pa.Table:
    """One row per (query, rank) from (Q, k) scores and item ids; with ``index``, each hit's dataset,
    label, class name and metadata (a catalogue table's other columns, JSON) too."""
    q, k = scores.shape
    table = pa.table({"query": np.repeat(np.array(queries, dtype=object), k),
                      "rank": np.tile(np.arange(1, k + 1, dtype=np.int32), q),
                      "item_id": item_ids.ravel(), "score": scores.ravel().astype(np.float32)})
    if index is None:
        return table
    flat = [str(i) for i in item_ids.ravel()]
    found = [i for i, name in enumerate(flat) if name]
    described = index.rows(index.lookup([flat[i] for i in found]), HIT_COLUMNS)
    for name in HIT_COLUMNS:
        values = [None] * len(flat)
        for i, value in zip(found, described[name].to_pylist(), strict=True):
            values[i] = value
        table = table.append_column(name, pa.array(values, described.schema.field(name).type
                                                   if len(described) else pa.string()))
    return table


def run_search(cfg: IndexConfig, k: int, queries_uri: str = "", item_ids: list[str] | None = None,
               out_uri: str = "", include_self: bool = False, image_uris: list[str] | None = None,
               checkpoint: str = "", grid_uri: str = "", where: Filter | None = None) -> SearchOutcome:
    """Search ``cfg.uri`` for the queries (a file, item ids or images) among the items ``where`` selects
    (a metadata filter, puma.index.filters) and write the results Parquet (a query with fewer matching
    items than k gets the ones there are)."""
    if sum(map(bool, (queries_uri, item_ids, image_uris))) != 1:
        raise IndexInputError("give exactly one kind of query: a queries file (--queries), item ids "
                              "(--item-id) or image files (--image)")
    index = ShardedIndex.open(cfg.uri, nprobe=cfg.nprobe, use_gpu=cfg.use_gpu, query_chunk=cfg.query_chunk,
                              keep_cpu=where is not None, holding=Holding(filters=where is not None))
    allowed = None if where is None else index.select(index.filter_mask(where))
    asked, (k, k_limit) = k, fit_k(index, k, exclude_self=bool(item_ids) and not include_self)
    if item_ids:
        names = list(item_ids)
        scores, found = index.search_by_item_id(names, k, exclude_self=not include_self, allowed=allowed)
    else:
        names, vectors = (embed_query_images(image_uris, checkpoint) if image_uris
                          else load_queries(queries_uri))
        if image_uris:
            check_query_model(index, checkpoint, vectors.shape[1])
        scores, found = index.search(vectors, k, allowed=allowed)
    table = results_table(names, scores, found, index)
    if where is not None:  # fewer matches than k: the padding rows go
        table = table.filter(pc.not_equal(table["item_id"], ""))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_uri = out_uri or storage.join("artifacts", "search", f"search-{stamp}.parquet")
    storage.write_bytes(out_uri, to_parquet_bytes(table))
    if grid_uri:
        queries = (indexed_items(index, names) if item_ids
                   else [GridItem(name, name if image_uris else "") for name in names])
        write_grid(grid_uri, retrieval_grid(queries, result_items(index, scores, found)))
    return SearchOutcome(out_uri, table, index.live_total, len(index.manifest.shards), grid_uri, k,
                         k_limit if k < asked else "")


def fit_k(index: ShardedIndex, k: int, exclude_self: bool) -> tuple[int, str]:
    """(k to search, why it is less than asked): k larger than what the index can return returns all."""
    if k < 1:
        raise IndexInputError(f"--k must be at least 1, got {k}")
    gpu_limited = index.max_k() < index.live_total
    most = index.max_k() - int(exclude_self)
    if most < 1:
        raise IndexInputError(f"index {index.uri} holds {index.live_total} item(s): no other item to return")
    why = (f"FAISS on GPU returns at most {index.max_k()} neighbours (index.use_gpu=false searches all)"
           if gpu_limited else f"the index holds {index.live_total} items"
           + (", the query item left out" if exclude_self else ""))
    return min(k, most), why


def embed_query_images(image_uris: list[str], checkpoint: str) -> tuple[list[str], np.ndarray]:
    """Image files -> (names, (Q, E) vectors) with the checkpoint's model and eval view."""
    if not checkpoint:
        raise IndexInputError("searching by image needs a checkpoint (--checkpoint URI)")
    from puma.checkpoint import load_model  # torch / timm only when searching by image
    from puma.inference.query import embed_images  # torch

    model, model_cfg = load_model(checkpoint)
    return embed_images(model, model_cfg, image_uris)


def check_query_model(index: ShardedIndex, checkpoint: str, dim: int) -> None:
    """Refuse query embeddings of another size than the index's; warn when the model ids differ."""
    mismatch = query_model_mismatch(index.manifest, index.uri, checkpoint, dim)
    if mismatch:
        log.warning("%s", mismatch)


def query_model_mismatch(manifest: Manifest, index_uri: str, checkpoint: str, dim: int,
                         query_id: str | None = None) -> str:
    """Why queries embedded by ``checkpoint`` (``dim``-dim, model id ``query_id``, computed when None)
    do not belong in the index ('' when they do, or when the index records no model id).

    Raises IndexInputError when the sizes differ: such vectors cannot be searched at all."""
    model_id = manifest.model_id
    if dim != manifest.dim:
        raise IndexInputError(f"checkpoint {checkpoint} embeds to {dim} dims but index {index_uri} holds "
                              f"{manifest.dim}-dim vectors (built by model {model_id or '?'!r}); search with "
                              f"the checkpoint the index was built with")
    if not model_id:
        return ""  # an index built without a model id (build_index from vectors): nothing to compare
    if query_id is None:
        from puma.checkpoint import checkpoint_id  # torch: only when searching by image

        query_id = checkpoint_id(checkpoint)
    if query_id == model_id:
        return ""
    return (f"index {index_uri} was built by model {model_id}, but the queries are embedded by checkpoint "
            f"{checkpoint} (model {query_id}): scores compare vectors of two models; use the index's "
            f"checkpoint")


def indexed_items(index: ShardedIndex, item_ids: list[str]) -> list[GridItem]:
    """Grid items of indexed items: their dataset, label and image location from the shards."""
    rows = index.rows(index.lookup(item_ids), GRID_COLUMNS).to_pylist()
    return [GridItem(item_id=str(r[ITEM_ID]), image_uri=r[IMAGE_URI] or "",
                     image_row=-1 if r[IMAGE_ROW] is None else int(r[IMAGE_ROW]), dataset=r[DATASET] or "",
                     label=NO_LABEL if r[LABEL] is None else int(r[LABEL])) for r in rows]


def result_items(index: ShardedIndex, scores: np.ndarray, found: np.ndarray) -> list[list[GridItem]]:
    """Grid items of every (query, rank) result, ranks and scores set; missing results ('') left out."""
    present = found != ""  # (Q, k)
    items = iter(indexed_items(index, [str(x) for x in found[present]]))
    rows = []
    for q in range(len(found)):
        row = []
        for rank in np.flatnonzero(present[q]):
            item = next(items)
            item.rank, item.score = int(rank) + 1, float(scores[q, rank])
            row.append(item)
        rows.append(row)
    return rows
