"""What the report draws from the index's stored embeddings and from the model itself.

- retrieval grids: per dataset, queries of distinct classes and their top-k by exact cosine search
  in numpy, within the query's own dataset (its gallery as evaluation defines it,
  ``puma.eval.metrics.query_gallery_masks``), the query itself left out;
- 2-D maps: t-SNE (scikit-learn) of a seeded sample of the unified embeddings, and of one dataset's
  (the one with the fewest classes, so that colours and legend can tell them apart);
- prompt-pool weights: alpha (paper Eq. 8) of up to 64 test images per dataset, eval view, no
  gradient; their mean per dataset x prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from puma import console
from puma.config import Config
from puma.data.images import ImageRejected, eval_view_spec, make_view
from puma.eval.metrics import query_gallery_masks
from puma.index.build import live_table
from puma.index.table import DATASET, IMAGE_ROW, IMAGE_URI, ITEM_ID, LABEL, ROLE, embedding_matrix
from puma.index.versions import resolve
from puma.inference.grid import GridItem

MIN_MAP_POINTS = 5  # fewer points make no t-SNE map


@dataclass
class IndexItems:
    """Every item of the index: its embedding (L2-normalised) and the columns the report needs."""

    vectors: np.ndarray  # (N, E) float32
    item_ids: np.ndarray  # (N,) str
    datasets: np.ndarray  # (N,) str
    labels: np.ndarray  # (N,) int64
    roles: np.ndarray  # (N,) str
    image_uris: np.ndarray  # (N,) str
    image_rows: np.ndarray  # (N,) int64

    def __len__(self) -> int:
        return len(self.item_ids)

    def dataset_names(self) -> list[str]:
        """The datasets, sorted."""
        return sorted(set(self.datasets.tolist()))

    def grid_item(self, row: int, rank: int = 0, score: float | None = None) -> GridItem:
        """One cell of a retrieval grid."""
        return GridItem(item_id=str(self.item_ids[row]), image_uri=str(self.image_uris[row]),
                        image_row=int(self.image_rows[row]), dataset=str(self.datasets[row]),
                        label=int(self.labels[row]), rank=rank, score=score)


def index_items(index: str) -> IndexItems:
    """The live rows of every shard of the index (its live version) as one IndexItems."""
    table = live_table(resolve(index))
    vectors = embedding_matrix(table)  # (N, E)
    vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)  # (N, E)

    def strings(name: str) -> np.ndarray:
        return np.asarray([str(v) for v in table[name].to_pylist()], dtype=str)

    return IndexItems(vectors, strings(ITEM_ID), strings(DATASET), _ints(table, LABEL), strings(ROLE),
                      strings(IMAGE_URI), _ints(table, IMAGE_ROW))


def _ints(table: pa.Table, name: str) -> np.ndarray:
    return table[name].to_numpy().astype(np.int64)


# ----------------------------------------------------------------------------- retrieval grids


def pick_queries(items: IndexItems, rows: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """Up to ``n`` of ``rows`` in a seeded order, one per class first, then any."""
    order = np.random.default_rng(seed).permutation(rows)
    picked, seen = [], set()
    for row in order:
        if items.labels[row] not in seen:
            seen.add(items.labels[row])
            picked.append(row)
    taken = set(picked)
    picked += [row for row in order if row not in taken]
    return np.asarray(picked[:n], dtype=np.int64)


def dataset_neighbours(items: IndexItems, dataset: str, queries: int, k: int,
                       seed: int = 0) -> tuple[list[GridItem], list[list[GridItem]]]:
    """Grid rows of one dataset: queries and their top-k by cosine within the dataset's gallery."""
    is_query, is_gallery = query_gallery_masks(items.datasets, items.roles)
    in_dataset = items.datasets == dataset
    gallery = np.flatnonzero(in_dataset & is_gallery)
    chosen = pick_queries(items, np.flatnonzero(in_dataset & is_query), queries, seed)
    scores = items.vectors[chosen] @ items.vectors[gallery].T  # (Q, G)
    scores[chosen[:, None] == gallery[None, :]] = -np.inf  # the query itself is not a result
    results = []
    for row_scores in scores:
        top = np.argsort(-row_scores, kind="stable")[:k]
        top = top[np.isfinite(row_scores[top])]
        results.append([items.grid_item(int(gallery[j]), rank=r, score=float(row_scores[j]))
                        for r, j in enumerate(top, start=1)])
    return [items.grid_item(int(row)) for row in chosen], results


# ----------------------------------------------------------------------------- 2-D maps


def sample_rows(n: int, points: int, seed: int = 0) -> np.ndarray:
    """A seeded, sorted sample of ``points`` of ``range(n)`` (all when n <= points)."""
    if n <= points:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=points, replace=False))


def tsne(vectors: np.ndarray, seed: int = 0) -> np.ndarray | None:
    """2-D t-SNE of (N, E) vectors -> (N, 2); None when there are too few points for a map."""
    from sklearn.manifold import TSNE
    from threadpoolctl import threadpool_limits

    if len(vectors) < MIN_MAP_POINTS:
        return None
    perplexity = float(min(30.0, max(1.0, (len(vectors) - 1) / 3)))  # must stay below N
    # one thread: on a busy 2-core machine two spinning OpenMP threads took a 16-point map from 0.3 s to 23 s
    with threadpool_limits(limits=1):
        fitted = TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=seed)
        return fitted.fit_transform(vectors)  # (N, 2)


def class_map_dataset(items: IndexItems) -> str:
    """The class-coloured map's dataset: the fewest classes (at least 2; a map a legend can explain),
    then the most items, then the first by name."""
    def rank(name: str) -> tuple[int, int, str]:
        mine = items.datasets == name
        classes = len(np.unique(items.labels[mine]))
        return (classes if classes >= 2 else 1 << 30, -int(mine.sum()), name)

    return min(items.dataset_names(), key=rank)


# ----------------------------------------------------------------------------- prompt-pool weights


def prompt_weights(model, model_cfg: Config, items: IndexItems, min_size: int,
                   per_dataset: int = 64) -> tuple[list[str], np.ndarray] | None:
    """(datasets, mean alpha (D, M)) over up to ``per_dataset`` images each; None without a prompt pool."""
    if getattr(model, "prompt_pool", None) is None:
        return None
    view = eval_view_spec(model_cfg, min_size=min_size)
    names, means = [], []
    with console.progress("prompt-pool weights", len(items.dataset_names()), "datasets") as bar:
        for name in items.dataset_names():
            rows = sample_rows(int((items.datasets == name).sum()), per_dataset)
            views = eval_views(items, np.flatnonzero(items.datasets == name)[rows], view)
            if len(views):
                names.append(name)
                means.append(pool_alpha(model, views).mean(axis=0))  # (M,)
            bar.update(1)
    return (names, np.stack(means)) if names else None


def eval_views(items: IndexItems, rows: np.ndarray, view) -> np.ndarray:
    """The eval views (n, 3, S, S) of the items' images; unreadable images are left out."""
    from puma.inference.embedder import read_image_bytes  # one read per Parquet file, not per image

    refs = pa.table({IMAGE_URI: items.image_uris[rows].tolist(), IMAGE_ROW: items.image_rows[rows].tolist()})
    out = []
    for data in read_image_bytes(refs):
        if isinstance(data, Exception) or not data:
            continue
        try:
            out.append(make_view(bytes(data), view))  # (3, S, S)
        except ImageRejected:
            continue
    size = view.img_size
    return np.stack(out) if out else np.zeros((0, 3, size, size), np.float32)


def pool_alpha(model, views: np.ndarray) -> np.ndarray:
    """alpha (n, M) = PromptPool.weights(patch_query(patch tokens)) of eval views (n, 3, S, S)."""
    import torch

    from puma.models.puma_model import patch_query

    with torch.inference_mode():
        x = torch.from_numpy(np.ascontiguousarray(views, np.float32))  # (n, 3, S, S)
        query = patch_query(model.backbone.patch_embed(x))  # (n, D), Eq. 6
        return model.prompt_pool.weights(query).float().numpy()  # (n, M), Eq. 8
