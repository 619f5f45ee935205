"""Evaluation through a sharded FAISS index: the paper's metrics, with neighbours from the index.

Same definitions and protocol as ``puma.eval.metrics.evaluate_embeddings`` (per dataset with its
own gallery, unified over all datasets with (dataset, class) labels, harmonic) and the same
accumulation (``evaluate_protocol`` / ``score_neighbours``); only the neighbour search differs:

- queries are the items' stored embeddings (the shards' embeddings.parquet), searched through
  every shard and merged (``ShardedIndex.search_ids``);
- a gallery smaller than the index (one dataset; In-Shop queries left out of the unified gallery)
  is enforced with a FAISS ID selector over global ids, not by filtering a longer result list;
- a query's own item is left out by global id (k + 1 searched, itself dropped);
- k is what the metrics need: max(max ks, max R_q), capped at the gallery size.

For a flat (exact) index the result equals ``evaluate_embeddings`` on the same vectors (up to
float ties); for IVF indexes the neighbours the probed lists miss change the scores (approximate;
with nprobe = nlist it is exact again). Rows without a class label (label -1) cannot be scored
and are refused. With ``use_gpu`` the unrestricted searches run on the GPU shards and the
restricted ones on CPU copies, because FAISS GPU indexes ignore ID selectors.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from puma import library_versions, storage
from puma.config import IndexConfig
from puma.eval.knn import RetrievalInputError
from puma.eval.metrics import NeighbourSearch, evaluate_protocol
from puma.index.layout import IndexFolder
from puma.index.manifest import LIBRARIES
from puma.index.search import ShardedIndex, drop_self
from puma.index.table import DATASET, EMBEDDING, INDEX_ID, ITEM_ID, LABEL, NO_LABEL, ROLE, embedding_matrix

log = logging.getLogger(__name__)
EVAL_COLUMNS = [INDEX_ID, ITEM_ID, EMBEDDING, DATASET, LABEL, ROLE]
NOT_SELF = -2  # own id of a query that is not in the gallery (never equals an id; -1 means "none")


def evaluate_index(uri: str, ks: Sequence[int] = (1, 2, 4, 8), nprobe: int = 16, use_gpu: bool = False,
                   chunk: int = 4096) -> dict[str, float]:
    """Per-dataset, unified and harmonic metrics of the items of index ``uri``, searched through it."""
    index = ShardedIndex.open(uri, nprobe=nprobe, use_gpu=use_gpu, keep_cpu=True)
    return evaluate_opened_index(index, ks, chunk)


def evaluate_opened_index(index: ShardedIndex, ks: Sequence[int] = (1, 2, 4, 8),
                          chunk: int = 4096) -> dict[str, float]:
    """``evaluate_index`` on an open index (its nprobe and devices as opened)."""
    table = eval_table(index)
    rows = np.flatnonzero(index.live)  # (L,) the index row of each live item: removed ones are not evaluated
    table = table.take(pa.array(rows))
    vectors = embedding_matrix(table)  # (L, E), row i = index row rows[i]
    labels = table[LABEL].to_numpy().astype(np.int64)
    datasets = np.asarray(table[DATASET].to_pylist(), dtype=str)
    roles = np.asarray(table[ROLE].to_pylist(), dtype=str)

    def searches(query_items: np.ndarray, gallery_items: np.ndarray,
                 self_index: np.ndarray) -> NeighbourSearch:
        return index_search(index, vectors, query_items, gallery_items, self_index, chunk, rows)

    return evaluate_protocol(labels, datasets, roles, ks, searches)


def eval_table(index: ShardedIndex) -> pa.Table:
    """The stored columns evaluation needs, row i = the index's row i, live rows only checked;
    refuses missing or unlabelled rows."""
    table = index.table(EVAL_COLUMNS, missing_ok=True)
    missing = [c for c in EVAL_COLUMNS if pa.types.is_null(table[c].type)]
    if missing:
        raise RetrievalInputError(f"index {index.uri} lacks column(s) {missing} needed for evaluation "
                                  f"(the catalogue contract in puma.index.table: dataset, label, role)")
    if len(table) != index.ntotal:
        raise RetrievalInputError(f"index {index.uri}: {len(table)} stored rows, {index.ntotal} loaded")
    live = table.filter(pa.array(index.live))
    for name in (DATASET, LABEL, ROLE):
        if live[name].null_count:
            raise RetrievalInputError(f"index {index.uri}: {live[name].null_count} row(s) have no {name}, "
                                      f"e.g. {_examples(live, live[name].is_null())}")
    unlabelled = pc.equal(live[LABEL], NO_LABEL)
    count = int(pc.sum(unlabelled).as_py() or 0)
    if count:
        raise RetrievalInputError(f"index {index.uri}: {count} row(s) have label {NO_LABEL} (no class), "
                                  f"so retrieval metrics cannot score them, e.g. "
                                  f"{_examples(live, unlabelled)}; evaluate a labelled test split")
    return table


def _examples(table: pa.Table, mask: pa.ChunkedArray, limit: int = 5) -> list[str]:
    return [str(x) for x in table.filter(mask)[ITEM_ID].to_pylist()[:limit]]


def index_search(index: ShardedIndex, vectors: np.ndarray, query_items: np.ndarray, gallery_items: np.ndarray,
                 self_index: np.ndarray, chunk: int, rows: np.ndarray | None = None) -> NeighbourSearch:
    """A NeighbourSearch through the index, restricted to ``gallery_items``; items are positions in
    ``rows`` (the index row of each evaluated item; default: every row)."""
    rows = np.arange(index.ntotal) if rows is None else rows
    allowed = None
    if len(gallery_items) < index.live_total:
        allowed = np.zeros(index.ntotal, dtype=bool)
        allowed[rows[gallery_items]] = True
    gallery_row = np.full(index.ntotal, -1, dtype=np.int64)  # (N,) index row -> gallery row
    gallery_row[rows[gallery_items]] = np.arange(len(gallery_items))
    own = np.where(self_index >= 0, rows[query_items], NOT_SELF)  # (Q,) own index row when in the gallery

    def search(rows: np.ndarray, k: int) -> Iterator[tuple[int, np.ndarray]]:
        exclude = bool((self_index[rows] >= 0).any())
        for start in range(0, len(rows), chunk):
            part = rows[start:start + chunk]
            scores, ids = index.search_ids(vectors[query_items[part]], k + exclude, allowed=allowed,
                                           widen=False)  # the index as configured: nprobe lists
            if exclude:
                scores, ids = drop_self(scores, ids, own[part])  # (n, k)
            yield start, np.where(ids >= 0, gallery_row[np.maximum(ids, 0)], -1)

    return search


def metrics_table(metrics: dict[str, float], keys: Sequence[str] = ("r@1", "map@r", "rp")) -> str:
    """Per-dataset, unified and harmonic rows of the given metrics, one column each."""
    names = sorted({k.split("/")[0] for k in metrics if "/" in k} - {"unified", "harmonic"})
    lines = [f"{'dataset':<16}" + "".join(f"{key:>10}" for key in keys)]
    for name in [*names, "unified", "harmonic"]:
        cells = [metrics.get(f"{name}/{key}") for key in keys]
        lines.append(f"{name:<16}" + "".join(f"{'-' if v is None else f'{v:.4f}':>10}" for v in cells))
    return "\n".join(lines)


def run_evaluation(uri: str, cfg: IndexConfig, ks: Sequence[int], out_uri: str = "",
                   chunk: int = 4096) -> tuple[dict[str, float], str]:
    """Evaluate the index at ``uri`` and write the metrics JSON (default ``<uri>/evaluation.json``)."""
    index = ShardedIndex.open(uri, nprobe=cfg.nprobe, use_gpu=cfg.use_gpu, keep_cpu=True)
    metrics = evaluate_opened_index(index, ks, chunk)
    manifest = index.manifest
    record = {"index": uri, "metrics": metrics, "ks": sorted(set(ks)), "nprobe": cfg.nprobe,
              "index_type": manifest.index_type, "factory": manifest.factory, "model_id": manifest.model_id,
              "items": index.ntotal, "shards": len(manifest.shards), "index_updated": manifest.updated,
              "evaluated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "versions": library_versions(LIBRARIES)}
    out_uri = out_uri or IndexFolder(uri).evaluation  # the index folder, unless another place is given
    storage.write_text(out_uri, json.dumps(record, indent=2, sort_keys=True))
    return metrics, out_uri
