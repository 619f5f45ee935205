"""What ``jobs/search.py`` does: load queries, search the sharded index, write a results table.

Queries are stored vectors (a ``.npy`` (Q, E) float array, or an embeddings Parquet with item_id
and embedding) or item ids already in the index (their stored embeddings, the item itself left
out). Results are one Parquet row per (query, rank): query, rank, item_id, score.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from puma import storage
from puma.config import IndexConfig
from puma.index.plan import IndexInputError
from puma.index.search import ShardedIndex
from puma.index.table import ITEM_ID, check_table, embedding_matrix, read_table, to_parquet_bytes


@dataclass
class SearchOutcome:
    """Where the results went and what they are."""

    out_uri: str
    results: pa.Table  # query, rank, item_id, score
    index_items: int
    index_shards: int


def load_queries(uri: str) -> tuple[list[str], np.ndarray]:
    """Query names and vectors (Q, E) from a .npy array or an embeddings Parquet."""
    if str(uri).endswith(".npy"):
        x = np.load(io.BytesIO(storage.read_bytes(uri)), allow_pickle=False)
        if x.ndim != 2:
            raise IndexInputError(f"{uri}: expected a (Q, E) array, got shape {x.shape}")
        return [f"q{i}" for i in range(len(x))], x
    table = check_table(read_table(uri))
    return [str(s) for s in table[ITEM_ID].to_pylist()], embedding_matrix(table)


def results_table(queries: list[str], scores: np.ndarray, item_ids: np.ndarray) -> pa.Table:
    """One row per (query, rank) from (Q, k) scores and item ids."""
    q, k = scores.shape
    return pa.table({"query": np.repeat(np.array(queries, dtype=object), k),
                     "rank": np.tile(np.arange(1, k + 1, dtype=np.int32), q),
                     "item_id": item_ids.ravel(), "score": scores.ravel().astype(np.float32)})


def run_search(cfg: IndexConfig, k: int, queries_uri: str = "", item_ids: list[str] | None = None,
               out_uri: str = "", include_self: bool = False) -> SearchOutcome:
    """Search ``cfg.uri`` for the queries (a file or item ids) and write the results Parquet."""
    if bool(queries_uri) == bool(item_ids):
        raise IndexInputError("give exactly one of a queries file (--queries) or item ids (--item-id)")
    index = ShardedIndex.open(cfg.uri, nprobe=cfg.nprobe, use_gpu=cfg.use_gpu, query_chunk=cfg.query_chunk)
    if item_ids:
        names = list(item_ids)
        scores, found = index.search_by_item_id(names, k, exclude_self=not include_self)
    else:
        names, vectors = load_queries(queries_uri)
        scores, found = index.search(vectors, k)
    table = results_table(names, scores, found)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_uri = out_uri or storage.join("artifacts", "search", f"search-{stamp}.parquet")
    storage.write_bytes(out_uri, to_parquet_bytes(table))
    return SearchOutcome(out_uri, table, index.ntotal, len(index.manifest.shards))
