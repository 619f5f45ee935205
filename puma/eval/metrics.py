"""Retrieval metrics: Recall@k, MAP@R and R-Precision, per dataset, unified and harmonic.

Definitions. A query q has label y_q; its gallery is ranked by descending inner product (cosine
for L2-normalised embeddings), with q itself removed when q is also a gallery item. Let n_i(q) be
the i-th neighbour and rel_i(q) = 1[y_{n_i(q)} = y_q].

- R_q = number of gallery items with label y_q (q itself not counted). Queries with R_q = 0 have
  nothing to find and are left out of every metric, as pytorch-metric-learning's
  AccuracyCalculator leaves out its "lone" queries.
- Recall@k = mean_q 1[sum_{i<=k} rel_i(q) >= 1]: the fraction of queries with at least one
  same-label item among the top k (the deep-metric-learning convention, not |hits| / R_q).
  For k larger than the gallery it is Recall@(gallery size).
- R-Precision = mean_q (1/R_q) sum_{i<=R_q} rel_i(q)  (Musgrave et al., "A metric learning
  reality check", 2020).
- MAP@R = mean_q (1/R_q) sum_{i<=R_q} P_q(i) rel_i(q), with P_q(i) = (1/i) sum_{j<=i} rel_j(q)
  (same paper).

All three come from one kNN search with k = max(max(ks), max_q R_q), capped at the gallery
size; the search runs in query chunks and the sums are accumulated per chunk, so memory stays
O(chunk * k). Keys: "r@1", "r@2", ..., "map@r", "rp". The search is a ``NeighbourSearch``:
exact (puma.eval.knn, ``evaluate_embeddings``) or through a sharded FAISS index
(puma.eval.index_eval); both feed the same accumulation (``score_neighbours``), so the two
paths differ only in which neighbours they find. A missing neighbour (-1) is never relevant.

Evaluation protocol (evaluate_protocol; paper Sec. 5.1 and DESIGN.md section 2):

- Per dataset: a dataset whose items carry both roles "query" and "gallery" (In-Shop) is
  evaluated query -> gallery; any other dataset all-vs-all, each image querying every other
  image of its dataset, itself excluded.
- Unified: all datasets pooled, labels keyed by (dataset, class), so equal class numbers from
  two datasets never match (the released code's bug). The pool is the union of the per-dataset
  protocols: unified queries = every all-vs-all image + In-Shop queries; unified gallery = every
  all-vs-all image + In-Shop gallery images. An In-Shop query is thus never a gallery item (and
  R_q counts only its In-Shop gallery matches, as per dataset), and images of other datasets
  compete with In-Shop gallery images as distractors.
- Harmonic: "harmonic/<metric>" is the harmonic mean over datasets of "<dataset>/<metric>"
  (the paper reports "harmonic/r@1"); 0 if any dataset scores 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from puma.eval.knn import RetrievalInputError, check_embeddings, iter_knn

ROLES = ("train", "query", "gallery")
RESERVED_NAMES = ("unified", "harmonic")


def _check_labels(labels: np.ndarray, n: int, name: str) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.shape != (n,):
        raise RetrievalInputError(f"{name} must have shape ({n},) like the embeddings, got {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise RetrievalInputError(f"{name} must be integers (int64), got dtype {labels.dtype}")
    return labels.astype(np.int64, copy=False)


def _check_strings(values: np.ndarray, n: int, name: str) -> np.ndarray:
    values = np.asarray(values)
    if values.shape != (n,):
        raise RetrievalInputError(f"{name} must have shape ({n},) like the embeddings, got {values.shape}")
    return values.astype(str)


def _check_ks(ks: Sequence[int]) -> tuple[int, ...]:
    ks = tuple(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1 for k in ks):
        raise RetrievalInputError(f"ks must be a non-empty sequence of positive ints, got {ks!r}")
    return tuple(sorted({int(k) for k in ks}))


def relevant_counts(
    query_labels: np.ndarray, gallery_labels: np.ndarray, self_index: np.ndarray
) -> np.ndarray:
    """R per query: gallery items with the query's label, the query itself (self_index >= 0) not counted."""
    classes, counts = np.unique(gallery_labels, return_counts=True)
    pos = np.minimum(np.searchsorted(classes, query_labels), len(classes) - 1)
    r = np.where(classes[pos] == query_labels, counts[pos], 0)  # (Q,)
    return r - (self_index >= 0)


def _chunk_sums(match: np.ndarray, r: np.ndarray, ks: tuple[int, ...]) -> dict[str, float]:
    """Per-chunk sums of each metric from match (n, K) = neighbour has the query's label, r (n,)."""
    sums = {f"r@{k}": float(match[:, :k].any(axis=1).sum()) for k in ks}
    ranks = np.arange(1, int(r.max()) + 1)  # (R_max,)
    rel = match[:, : len(ranks)] & (ranks[None, :] <= r[:, None])  # (n, R_max) hits within top R_q
    precision = np.cumsum(rel, axis=1) / ranks  # (n, R_max) P_q(i)
    sums["map@r"] = float(((precision * rel).sum(axis=1) / r).sum())
    sums["rp"] = float((rel.sum(axis=1) / r).sum())
    return sums


# A neighbour search: (query rows (n,), k) -> yields (start, gallery rows (m, k) int64) for
# rows[start:start+m], best first, each query's own gallery row already left out; -1 = no neighbour
# (an approximate index may find fewer than k). The exact search (iter_knn) and the search through
# a sharded FAISS index (puma.eval.index_eval) are two such functions over the same accumulation.
NeighbourSearch = Callable[[np.ndarray, int], Iterable[tuple[int, np.ndarray]]]
# What a protocol needs: (query items (Q,), gallery items (G,), self_index (Q,)) -> a NeighbourSearch,
# items being positions in the evaluated set and self_index a query's row in the gallery or -1.
SearchFactory = Callable[[np.ndarray, np.ndarray, np.ndarray], NeighbourSearch]


def neighbours_needed(r: np.ndarray, ks: tuple[int, ...], gallery_size: int, self_index: np.ndarray) -> int:
    """k the metrics need: max(max ks, max R_q), capped at the gallery size (less the query itself)."""
    return min(max(max(ks), int(r.max())), gallery_size - int((self_index >= 0).any()))


def score_neighbours(
    query_labels: np.ndarray,
    gallery_labels: np.ndarray,
    self_index: np.ndarray,
    ks: tuple[int, ...],
    search: NeighbourSearch,
) -> dict[str, float]:
    """Metrics over the queries that have at least one relevant gallery item, from ``search``."""
    r = relevant_counts(query_labels, gallery_labels, self_index)
    found = np.flatnonzero(r > 0)  # (Q',) query rows that count
    if not len(found):
        raise RetrievalInputError(f"none of the {len(query_labels)} queries has a same-label item in the "
                                  "gallery")
    query_labels, r = query_labels[found], r[found]
    k = neighbours_needed(r, ks, len(gallery_labels), self_index[found])
    totals: dict[str, float] = {}
    scored = 0
    for start, rows in search(found, k):
        stop = start + len(rows)
        match = (rows >= 0) & (gallery_labels[rows] == query_labels[start:stop, None])  # (n, k)
        for key, value in _chunk_sums(match, r[start:stop], ks).items():
            totals[key] = totals.get(key, 0.0) + value
        scored += len(rows)
    if scored != len(found):
        raise RetrievalInputError(f"the neighbour search answered {scored} of {len(found)} queries")
    return {key: value / len(found) for key, value in totals.items()}


def exact_search(query: np.ndarray, gallery: np.ndarray, self_index: np.ndarray,
                 chunk: int) -> NeighbourSearch:
    """The exact inner-product NeighbourSearch of query rows against the gallery (puma.eval.knn)."""

    def search(rows: np.ndarray, k: int) -> Iterator[tuple[int, np.ndarray]]:
        for start, _, indices in iter_knn(query[rows], gallery, k, self_index=self_index[rows], chunk=chunk):
            yield start, indices

    return search


def retrieval_metrics(
    query_emb: np.ndarray,
    query_labels: np.ndarray,
    gallery_emb: np.ndarray,
    gallery_labels: np.ndarray,
    ks: Sequence[int] = (1, 2, 4, 8),
    exclude_self: bool = False,
    chunk: int = 4096,
) -> dict[str, float]:
    """Recall@k, MAP@R and R-Precision of queries against a gallery (see the module docstring)."""
    query_emb = check_embeddings(query_emb, "query_emb")
    gallery_emb = check_embeddings(gallery_emb, "gallery_emb")
    query_labels = _check_labels(query_labels, len(query_emb), "query_labels")
    gallery_labels = _check_labels(gallery_labels, len(gallery_emb), "gallery_labels")
    self_index = np.full(len(query_emb), -1, np.int64)
    if exclude_self:
        same = query_emb.shape == gallery_emb.shape and np.array_equal(query_emb, gallery_emb)
        if not (same and np.array_equal(query_labels, gallery_labels)):
            raise RetrievalInputError("exclude_self=True needs query and gallery to be the same set")
        self_index = np.arange(len(query_emb), dtype=np.int64)
    search = exact_search(query_emb, gallery_emb, self_index, chunk)
    return score_neighbours(query_labels, gallery_labels, self_index, _check_ks(ks), search)


def harmonic_mean(values: Sequence[float]) -> float:
    """Harmonic mean of non-negative values; 0 if any value is 0."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0 or (values < 0).any():
        raise RetrievalInputError(f"harmonic mean needs non-negative values, got {values.tolist()}")
    return 0.0 if (values == 0).any() else float(len(values) / (1.0 / values).sum())


def query_gallery_masks(datasets: np.ndarray, roles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(is_query, is_gallery) per item: query/gallery roles where a dataset has both, else all-vs-all."""
    unknown = sorted(set(np.unique(roles)) - set(ROLES))
    if unknown:
        raise RetrievalInputError(f"unknown roles {unknown}; valid roles are {list(ROLES)}")
    split = np.zeros(len(roles), dtype=bool)
    for name in np.unique(datasets):
        in_dataset = datasets == name
        present = set(np.unique(roles[in_dataset]))
        if {"query", "gallery"} <= present:
            if "train" in present:
                raise RetrievalInputError(f"dataset {name!r} mixes role 'train' with 'query'/'gallery'")
            split |= in_dataset
    return ~split | (roles == "query"), ~split | (roles == "gallery")


def pooled_metrics(
    labels: np.ndarray,
    is_query: np.ndarray,
    is_gallery: np.ndarray,
    ks: tuple[int, ...],
    searches: SearchFactory,
) -> dict[str, float]:
    """Metrics of the is_query items against the is_gallery items, each query's own item excluded."""
    query_items, gallery_items = np.flatnonzero(is_query), np.flatnonzero(is_gallery)  # (Q,), (G,)
    gallery_row = np.cumsum(is_gallery) - 1  # (N,) row of each item in the gallery subset
    self_index = np.where(is_gallery, gallery_row, -1)[query_items]  # (Q,)
    search = searches(query_items, gallery_items, self_index)
    return score_neighbours(labels[query_items], labels[gallery_items], self_index, ks, search)


def unified_labels(datasets: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """One int64 label per (dataset, class) pair, so class numbers never collide across datasets."""
    _, dataset_code = np.unique(datasets, return_inverse=True)
    pairs = np.stack([dataset_code.reshape(-1), labels], axis=1)  # (N, 2)
    _, keys = np.unique(pairs, axis=0, return_inverse=True)
    return keys.reshape(-1).astype(np.int64)


def evaluate_embeddings(
    emb: np.ndarray,
    labels: np.ndarray,
    datasets: np.ndarray,
    roles: np.ndarray,
    ks: Sequence[int] = (1, 2, 4, 8),
    chunk: int = 4096,
) -> dict[str, float]:
    """Per-dataset ("<dataset>/r@1"), unified ("unified/...") and harmonic ("harmonic/...") metrics."""
    emb = check_embeddings(emb, "emb")
    labels = _check_labels(labels, len(emb), "labels")

    def searches(query_items: np.ndarray, gallery_items: np.ndarray,
                 self_index: np.ndarray) -> NeighbourSearch:
        return exact_search(emb[query_items], emb[gallery_items], self_index, chunk)

    return evaluate_protocol(labels, datasets, roles, ks, searches)


def evaluate_protocol(
    labels: np.ndarray,
    datasets: np.ndarray,
    roles: np.ndarray,
    ks: Sequence[int],
    searches: SearchFactory,
) -> dict[str, float]:
    """The evaluation protocol (module docstring) over any neighbour search of the N items."""
    labels = _check_labels(labels, len(labels), "labels")
    datasets = _check_strings(datasets, len(labels), "datasets")
    roles = _check_strings(roles, len(labels), "roles")
    ks = _check_ks(ks)
    names = [str(name) for name in np.unique(datasets)]
    if set(names) & set(RESERVED_NAMES):
        raise RetrievalInputError(f"dataset names {list(RESERVED_NAMES)} are reserved, got {names}")
    is_query, is_gallery = query_gallery_masks(datasets, roles)
    out: dict[str, float] = {}
    for name in names:
        sel = datasets == name
        try:
            per_dataset = pooled_metrics(labels, is_query & sel, is_gallery & sel, ks, searches)
        except RetrievalInputError as err:
            raise RetrievalInputError(f"dataset {name!r}: {err}") from err
        out.update({f"{name}/{key}": value for key, value in per_dataset.items()})
    unified = pooled_metrics(unified_labels(datasets, labels), is_query, is_gallery, ks, searches)
    out.update({f"unified/{key}": value for key, value in unified.items()})
    out.update({f"harmonic/{key}": harmonic_mean([out[f"{n}/{key}"] for n in names]) for key in unified})
    return out
