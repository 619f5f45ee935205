"""Exact k-nearest-neighbour search by inner product through FAISS, in bounded memory.

Embeddings are L2-normalised, so inner product is cosine similarity. The gallery is held in one
``faiss.IndexFlatIP`` (exact, no training); queries are searched ``chunk`` rows at a time, so a
150K x 150K evaluation holds at most ``chunk x k`` results at once and never a 150K^2 matrix.

Self-exclusion: when a query is also an item of the gallery (``self_index[i] >= 0`` is its gallery
row), ``k + 1`` neighbours are searched and the query's own row is dropped by *index*, not by
distance, so exact duplicates of the query stay in its result. If ties push the query itself out
of its ``k + 1`` neighbours, the last neighbour is dropped instead.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import faiss
import numpy as np

from puma.errors import UserError

GPU_MAX_K = 2048  # FAISS GPU k-selection limit; larger k searches on the CPU index


class RetrievalInputError(UserError, ValueError):
    """Embeddings, labels or search parameters that retrieval cannot use."""


def check_embeddings(x: np.ndarray, name: str) -> np.ndarray:
    """Validate a non-empty finite (N, D) array and return it as C-contiguous float32."""
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise RetrievalInputError(f"{name} must be a non-empty (N, D) array, got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise RetrievalInputError(f"{name} must be floating point, got dtype {x.dtype}")
    if not np.isfinite(x).all():
        bad = int((~np.isfinite(x).all(axis=1)).sum())
        raise RetrievalInputError(f"{name} has {bad} row(s) with NaN or Inf values")
    return np.ascontiguousarray(x, dtype=np.float32)


@functools.lru_cache(maxsize=1)
def _gpu_resources() -> faiss.StandardGpuResources:
    return faiss.StandardGpuResources()


def build_index(gallery: np.ndarray, k: int) -> faiss.Index:
    """Exact inner-product index over the gallery; on GPU 0 when FAISS sees a GPU and k allows."""
    index = faiss.IndexFlatIP(gallery.shape[1])
    index.add(gallery)
    if faiss.get_num_gpus() > 0 and k <= GPU_MAX_K:
        index = faiss.index_cpu_to_gpu(_gpu_resources(), 0, index)
    return index


def _check_search(query: np.ndarray, gallery: np.ndarray, k: int, self_index: np.ndarray, chunk: int) -> None:
    if query.shape[1] != gallery.shape[1]:
        raise RetrievalInputError(f"query dim {query.shape[1]} != gallery dim {gallery.shape[1]}")
    if chunk < 1:
        raise RetrievalInputError(f"chunk must be >= 1, got {chunk}")
    if self_index.shape != (len(query),):
        raise RetrievalInputError(f"self_index must have shape ({len(query)},), got {self_index.shape}")
    if self_index.min() < -1 or self_index.max() >= len(gallery):
        raise RetrievalInputError(f"self_index values must be -1 or in [0, {len(gallery)})")
    available = len(gallery) - int((self_index >= 0).any())
    if not 1 <= k <= available:
        raise RetrievalInputError(f"k must be in [1, {available}] for this gallery and exclusion, got {k}")


def _drop_self(scores: np.ndarray, indices: np.ndarray, self_index: np.ndarray) -> tuple[np.ndarray, ...]:
    """Drop each row's own gallery index (or its last neighbour): (n, k+1) -> (n, k)."""
    drop = indices == self_index[:, None]  # (n, k+1); rows with self_index -1 never match
    drop[~drop.any(axis=1), -1] = True
    keep = ~drop
    n, k = len(indices), indices.shape[1] - 1
    return scores[keep].reshape(n, k), indices[keep].reshape(n, k)


def iter_knn(
    query: np.ndarray,
    gallery: np.ndarray,
    k: int,
    *,
    self_index: np.ndarray | None = None,
    chunk: int = 4096,
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Yield (start, scores (n, k) float32, indices (n, k) int64) for query rows start:start+n.

    ``self_index[i]`` is the gallery row of query i itself (excluded from its neighbours) or -1.
    """
    query, gallery = check_embeddings(query, "query"), check_embeddings(gallery, "gallery")
    self_index = np.full(len(query), -1, np.int64) if self_index is None else np.asarray(self_index)
    _check_search(query, gallery, k, self_index, chunk)
    exclude = bool((self_index >= 0).any())
    index = build_index(gallery, k + exclude)
    for start in range(0, len(query), chunk):
        scores, indices = index.search(query[start : start + chunk], k + exclude)  # (n, k [+1])
        if exclude:
            scores, indices = _drop_self(scores, indices, self_index[start : start + chunk])
        yield start, scores.astype(np.float32, copy=False), indices.astype(np.int64, copy=False)


def knn_search(
    query: np.ndarray,
    gallery: np.ndarray,
    k: int,
    *,
    exclude_self: bool = False,
    chunk: int = 4096,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k gallery neighbours of each query by inner product: (scores (Q,k), indices (Q,k)).

    With ``exclude_self`` the query set must be the gallery set (row i of both is the same item),
    and each query's own row is removed from its neighbours.
    """
    query, gallery = check_embeddings(query, "query"), check_embeddings(gallery, "gallery")
    self_index = None
    if exclude_self:
        if np.shape(query) != np.shape(gallery) or not np.array_equal(query, gallery):
            raise RetrievalInputError("exclude_self=True needs query and gallery to be the same set")
        self_index = np.arange(len(query), dtype=np.int64)
    parts = list(iter_knn(query, gallery, k, self_index=self_index, chunk=chunk))
    return np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts])
