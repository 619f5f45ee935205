"""Which FAISS index to build for N vectors of dimension E under a memory budget (autofaiss-like).

Memory estimates (bytes, the whole index in memory at search time, ids are int64):

    flat      N * (4E + 8)
    ivf_flat  N * (4E + 8) + 4E * nlist                       (vectors + ids, coarse centroids)
    ivf_pq    N * (m + 8) + 4E * nlist + 4E * 256             (codes + ids, centroids, PQ codebooks)

``auto`` picks, in order: exact ``flat`` when N <= flat_max_items and it fits; ``ivf_flat`` when it
fits; ``ivf_pq`` with the largest code size m <= E/4 that fits; otherwise it raises.
nlist follows the usual rule: 4 * sqrt(N) rounded to a power of two, capped at N / 39 so k-means
has at least 39 training points per list. IVF trains on ``train_sample`` vectors (auto: 64 * nlist,
at least 39 per k-means centroid, at most N).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from puma.config import IndexConfig
from puma.errors import UserError

MIN_POINTS_PER_LIST = 39  # FAISS warns below this many training points per centroid
PQ_NBITS = 8
PQ_CENTROIDS = 1 << PQ_NBITS
GB = 1 << 30


class IndexInputError(UserError, ValueError):
    """A table, query, config or index that this index cannot use; the message says what is valid."""


@dataclass(frozen=True)
class IndexPlan:
    """A chosen index layout: type, FAISS factory string, sizes and the memory estimate."""

    index_type: str  # flat | ivf_flat | ivf_pq
    factory: str  # FAISS index_factory string, e.g. "IVF4096,Flat"
    dim: int
    metric: str
    nlist: int = 0
    pq_m: int = 0
    train_sample: int = 0  # vectors used to train (0 for flat)
    expected_items: int = 0
    memory_bytes: int = 0


def auto_nlist(n_items: int) -> int:
    """4*sqrt(N) rounded to a power of two, capped so every list gets >= 39 training points."""
    if n_items < 1:
        raise IndexInputError(f"need at least 1 item to size an IVF index, got {n_items}")
    target = 2 ** round(math.log2(max(1.0, 4.0 * math.sqrt(n_items))))
    cap = max(1, n_items // MIN_POINTS_PER_LIST)
    return int(max(1, min(target, 2 ** int(math.log2(cap)))))


def estimate_memory_bytes(index_type: str, n_items: int, dim: int, nlist: int = 0, pq_m: int = 0) -> int:
    """Bytes the index needs in memory (see the module docstring for the formulas)."""
    ids = 8 * n_items
    if index_type == "flat":
        return n_items * 4 * dim + ids
    if index_type == "ivf_flat":
        return n_items * 4 * dim + ids + 4 * dim * nlist
    if index_type == "ivf_pq":
        return n_items * pq_m + ids + 4 * dim * nlist + 4 * dim * PQ_CENTROIDS
    raise IndexInputError(f"unknown index type {index_type!r}; valid: flat, ivf_flat, ivf_pq")


def pq_candidates(dim: int) -> list[int]:
    """Code sizes m (bytes) that divide E with >= 4 dimensions per sub-quantizer, largest first."""
    return [m for m in range(dim // 4, 0, -1) if dim % m == 0]


def plan_index(cfg: IndexConfig, n_items: int, dim: int) -> IndexPlan:
    """The index for ``n_items`` vectors of ``dim`` under ``cfg`` (type, nlist, pq_m, memory)."""
    if n_items < 1 or dim < 1:
        raise IndexInputError(f"cannot plan an index for {n_items} items of dimension {dim}")
    budget = int(cfg.memory_budget_gb * GB)
    index_type = cfg.index_type if cfg.index_type != "auto" else _auto_type(cfg, n_items, dim, budget)
    if index_type == "flat":
        return _plan(cfg, "flat", n_items, dim, 0, 0)
    nlist = cfg.nlist or auto_nlist(n_items)
    if index_type == "ivf_flat":
        return _plan(cfg, "ivf_flat", n_items, dim, nlist, 0)
    pq_m = cfg.pq_m or _auto_pq_m(n_items, dim, nlist, budget)
    if dim % pq_m:
        raise IndexInputError(f"index.pq_m={pq_m} must divide the embedding dimension {dim}; "
                              f"valid: {[m for m in range(1, dim + 1) if dim % m == 0]}")
    return _plan(cfg, "ivf_pq", n_items, dim, nlist, pq_m)


def _auto_type(cfg: IndexConfig, n_items: int, dim: int, budget: int) -> str:
    if n_items <= cfg.flat_max_items and estimate_memory_bytes("flat", n_items, dim) <= budget:
        return "flat"
    if estimate_memory_bytes("ivf_flat", n_items, dim, auto_nlist(n_items)) <= budget:
        return "ivf_flat"
    return "ivf_pq"


def _auto_pq_m(n_items: int, dim: int, nlist: int, budget: int) -> int:
    """The largest code size that fits the budget; raises when even the smallest does not."""
    candidates = pq_candidates(dim) or [1]
    for m in candidates:
        if estimate_memory_bytes("ivf_pq", n_items, dim, nlist, m) <= budget:
            return m
    need = estimate_memory_bytes("ivf_pq", n_items, dim, nlist, candidates[-1]) / GB
    raise IndexInputError(f"{n_items} items x {dim} dims need {need:.2f} GB even as IVF-PQ with "
                          f"m={candidates[-1]}; budget is {budget / GB:.2f} GB: raise "
                          f"index.memory_budget_gb or shrink the catalogue")


def _plan(cfg: IndexConfig, index_type: str, n_items: int, dim: int, nlist: int, pq_m: int) -> IndexPlan:
    factory = {"flat": "IDMap,Flat", "ivf_flat": f"IVF{nlist},Flat",
               "ivf_pq": f"IVF{nlist},PQ{pq_m}x{PQ_NBITS}"}[index_type]
    return IndexPlan(index_type=index_type, factory=factory, dim=dim, metric=cfg.metric, nlist=nlist,
                     pq_m=pq_m, train_sample=_train_sample(cfg, index_type, n_items, nlist),
                     expected_items=n_items,
                     memory_bytes=estimate_memory_bytes(index_type, n_items, dim, nlist, pq_m))


def _train_sample(cfg: IndexConfig, index_type: str, n_items: int, nlist: int) -> int:
    """Training vectors: 0 for flat; else cfg.train_sample or 64*nlist, at least 39 per centroid, <= N."""
    if index_type == "flat":
        return 0
    wanted = cfg.train_sample or 64 * nlist
    floor = MIN_POINTS_PER_LIST * max(nlist, PQ_CENTROIDS if index_type == "ivf_pq" else 1)
    return int(min(n_items, max(wanted, floor)))
