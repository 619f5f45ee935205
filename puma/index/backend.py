"""The FAISS calls in one place: build, train (GPU k-means when FAISS sees GPUs), (de)serialise, tune,
search restricted to a set of ids (``id_selector``; FAISS GPU indexes ignore selectors, so restricted
searches run on CPU copies of the shards), inverted lists moved to a memory-mapped file
(``lists_on_disk``).

Only this module imports faiss, and only inside the functions that call it, so importing
``puma.index`` does not load faiss (Ray Data decode workers import ``puma.index.table`` for its
column names and Parquet reads, and need no faiss). GPUs are used when ``use_gpu`` is set and
``faiss.get_num_gpus() > 0`` (a faiss-gpu build on a GPU machine); otherwise everything runs on CPU.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import numpy as np

from puma.index.plan import PQ_CENTROIDS, IndexInputError, IndexPlan

if TYPE_CHECKING:
    import faiss

log = logging.getLogger(__name__)
GPU_MAX_K = 2048  # FAISS GPU k-selection limit
METRICS = {"ip": "METRIC_INNER_PRODUCT", "l2": "METRIC_L2"}  # plan.metric -> faiss constant name


def gpus_available(use_gpu: bool) -> bool:
    """True when GPUs are wanted and FAISS sees at least one."""
    import faiss

    return bool(use_gpu) and faiss.get_num_gpus() > 0


def new_index(plan: IndexPlan) -> faiss.Index:
    """An empty CPU index from the plan's factory string and metric."""
    import faiss

    return faiss.index_factory(plan.dim, plan.factory, getattr(faiss, METRICS[plan.metric]))


def ivf_of(index: faiss.Index) -> faiss.IndexIVF | None:
    """The IVF part of an index, or None for flat indexes."""
    import faiss

    try:
        return faiss.downcast_index(faiss.extract_index_ivf(index))  # its own class: IndexIVFPQ, ...
    except RuntimeError:
        return None


def train_index(index: faiss.Index, x: np.ndarray, use_gpu: bool) -> faiss.Index:
    """Train ``index`` on x (n, E); the coarse k-means runs on all GPUs when available."""
    import faiss

    ivf = ivf_of(index)
    if ivf is None:
        return index  # flat: nothing to learn
    _check_train_size(ivf, len(x))
    if isinstance(ivf, faiss.IndexIVFPQ):  # polysemous codes serve Hamming-filtered search, not used here;
        ivf.do_polysemous_training = False  # its training took most of a PQ index's (10 s on 300 vectors)
    gpu_flat = None
    if gpus_available(use_gpu):  # k-means assignment on all GPUs; the reference keeps it alive
        gpu_flat = faiss.index_cpu_to_all_gpus(faiss.IndexFlat(ivf.d, ivf.metric_type))
        ivf.clustering_index = gpu_flat
    index.train(x)
    ivf.clustering_index = None
    del gpu_flat
    return index


def _check_train_size(ivf: faiss.IndexIVF, n: int) -> None:
    import faiss

    need = max(ivf.nlist, PQ_CENTROIDS if isinstance(ivf, faiss.IndexIVFPQ) else 1)
    if n < need:
        raise IndexInputError(f"training {ivf.nlist} IVF lists needs at least {need} vectors, got {n}; "
                              f"lower index.nlist or use index.index_type=flat")


def serialize(index: faiss.Index) -> bytes:
    """The index as bytes (FAISS's own format)."""
    import faiss

    return faiss.serialize_index(index).tobytes()


def deserialize(data: bytes) -> faiss.Index:
    """An index from ``serialize`` bytes."""
    import faiss

    return faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))


@functools.lru_cache(maxsize=1)
def _cloner_options() -> faiss.GpuMultipleClonerOptions:
    import faiss

    options = faiss.GpuMultipleClonerOptions()
    options.useFloat16LookupTables = True  # IVF-PQ with large codes needs it on GPU
    return options


def to_search_device(index: faiss.Index, use_gpu: bool) -> tuple[faiss.Index, bool]:
    """The index on all GPUs when available (falls back to CPU on an unsupported layout)."""
    import faiss

    if not gpus_available(use_gpu):
        return index, False
    try:
        return faiss.index_cpu_to_all_gpus(index, co=_cloner_options()), True
    except RuntimeError as exc:
        log.warning("FAISS could not move this index to GPU (%s); searching it on CPU", exc)
        return index, False


def lists_on_disk(index: faiss.Index, path: str) -> bool:
    """Move a CPU IVF index's inverted lists into a memory-mapped file at ``path`` (FAISS
    OnDiskInvertedLists; the same codes and ids in the same order, so searches give identical results);
    the in-memory lists are freed. False (nothing done) for flat indexes."""
    import faiss

    ivf = ivf_of(index)
    if ivf is None:
        return False
    on_disk = faiss.OnDiskInvertedLists(ivf.nlist, ivf.code_size, path)
    lists = faiss.InvertedListsPtrVector()
    lists.push_back(ivf.invlists)
    on_disk.merge_from_multiple(lists.data(), lists.size(), False, False)
    ivf.replace_invlists(on_disk, True)  # the index owns (and frees) the on-disk lists; the old are freed
    on_disk.this.disown()
    return True


def trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc keeps what loading freed, e.g. the many small list
    buffers of lists moved to disk, in its per-thread arenas otherwise)."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def stacked_lists(trained: faiss.Index, shards: list[faiss.Index]) -> tuple[faiss.IndexIVF, tuple]:
    """One IVF index over the CPU IVF shards' inverted lists, read in place (FAISS HStackInvertedLists:
    its list l is the shards' lists l one after another), so one ``search_preassigned`` scans every shard
    as one index holding all their vectors in shard order would. Returns it and what must outlive it."""
    import faiss

    view = faiss.clone_index(trained)  # the empty trained index: its quantizer and parameters
    ivf = ivf_of(view)
    lists = faiss.InvertedListsPtrVector()
    for shard in shards:
        lists.push_back(ivf_of(shard).invlists)
    stacked = faiss.HStackInvertedLists(len(shards), lists.data())
    ivf.replace_invlists(stacked, False)
    ivf.ntotal = sum(shard.ntotal for shard in shards)
    return ivf, (view, stacked, list(shards))


def lists_of_rows(shard: faiss.Index, id_start: int, count: int, nlist: int) -> np.ndarray:
    """The inverted list of each of a CPU IVF shard's ``count`` rows (global ids ``id_start`` on; -1: in
    none, e.g. removed), int16 while nlist allows it: 2 bytes an item."""
    import faiss

    out = np.full(count, -1, dtype=np.int16 if nlist < 2**15 else np.int32)
    invlists = ivf_of(shard).invlists
    for number in range(invlists.nlist):
        n = invlists.list_size(number)
        if n:
            pointer = invlists.get_ids(number)
            out[faiss.rev_swig_ptr(pointer, n) - id_start] = number
            invlists.release_ids(number, pointer)
    return out


def set_nprobe(index: faiss.Index, nprobe: int, on_gpu: bool) -> None:
    """Lists visited per query for IVF indexes (no-op for flat)."""
    import faiss

    if on_gpu:
        faiss.GpuParameterSpace().set_index_parameter(index, "nprobe", nprobe)
    elif ivf_of(index) is not None:
        faiss.extract_index_ivf(index).nprobe = nprobe


def id_selector(allowed: np.ndarray) -> faiss.IDSelector:
    """A FAISS selector of the global ids whose entry in the bool mask ``allowed`` (N,) is True."""
    bits = np.packbits(np.asarray(allowed, dtype=bool), bitorder="little")  # (ceil(N/8),) uint8
    return bitmap_selector(bits)


def bitmap_selector(bits: np.ndarray) -> faiss.IDSelector:
    """A FAISS selector of the global ids whose bit is set in ``bits`` (little-endian packed uint8)."""
    import faiss

    bits = np.ascontiguousarray(bits, dtype=np.uint8)
    selector = faiss.IDSelectorBitmap(len(bits), faiss.swig_ptr(bits))  # its n: the bitmap's bytes
    selector.referenced_objects = [bits]  # the bitmap must live as long as the selector
    return selector


def search(index: faiss.Index, q: np.ndarray, k: int,
           selector: faiss.IDSelector | None = None) -> tuple[np.ndarray, np.ndarray]:
    """index.search (Q, E) -> (Q, k) scores, ids; only ids the selector allows (CPU indexes only)."""
    import faiss

    if selector is None:
        return index.search(q, k)
    # The C++ method: faiss.contrib.torch_utils (imported by pytorch-metric-learning) replaces
    # Index.search process-wide with a version that takes no params.
    q = np.ascontiguousarray(q, dtype=np.float32)  # (n, E)
    n = len(q)
    scores, ids = np.empty((n, k), dtype=np.float32), np.empty((n, k), dtype=np.int64)
    index.search_c(n, faiss.swig_ptr(q), k, faiss.swig_ptr(scores), faiss.swig_ptr(ids),
                   faiss.SearchParameters(sel=selector))
    return scores, ids


def search_preassigned(ivf: faiss.IndexIVF, q: np.ndarray, k: int, lists: np.ndarray,
                       coarse_scores: np.ndarray,
                       selector: faiss.IDSelector | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Scan the given lists (Q, nprobe) of an IVF index; only ids the selector allows. The probe count
    travels with the call (the index's own nprobe is not read, so concurrent searches may differ)."""
    import faiss

    n = len(q)  # the Python wrapper refuses params here, so call the C++ method with them
    q = np.ascontiguousarray(q, dtype=np.float32)
    scores, ids = np.empty((n, k), dtype=np.float32), np.empty((n, k), dtype=np.int64)
    lists = np.ascontiguousarray(lists, dtype=np.int64)  # (n, nprobe)
    coarse_scores = np.ascontiguousarray(coarse_scores, dtype=np.float32)  # (n, nprobe)
    params = faiss.SearchParametersIVF(nprobe=lists.shape[1])
    if selector is not None:
        params.sel = selector
    ivf.search_preassigned_c(n, faiss.swig_ptr(q), k, faiss.swig_ptr(lists), faiss.swig_ptr(coarse_scores),
                             faiss.swig_ptr(scores), faiss.swig_ptr(ids), False, params)
    return scores, ids


def scores_of_rows(matrix: np.ndarray, q: np.ndarray, rows: np.ndarray, metric: str) -> np.ndarray:
    """One query q (E,) against ``matrix[rows]`` (matrix (N, E) float32 C-contiguous, e.g. mapped from a
    column file; rows (n,) in [0, N)) without gathering them: (n,) float32 inner products ("ip") or
    squared distances ("l2"), each row scored alone (its score does not depend on the others).

    On the calling thread only, as FAISS searches a single query: FAISS's by-id functions open an
    OpenMP team whatever their size, and a team's barrier waits for every thread of it, which on a
    busy machine waits for the scheduler (a 2-second test took 62 s with one of two cores taken)."""
    import faiss

    n, dim = len(rows), matrix.shape[1]
    if n == 0:
        return np.zeros(0, dtype=np.float32)
    if matrix.dtype != np.float32 or not matrix.flags.c_contiguous or q.shape != (dim,):
        raise ValueError(f"scores_of_rows needs a C-contiguous float32 (N, {dim}) matrix and a ({dim},) "
                         f"query; got {matrix.dtype} {matrix.shape} and {q.shape}")
    if rows.min() < 0 or rows.max() >= len(matrix):
        raise IndexError(f"rows outside [0, {len(matrix)}) asked of a {len(matrix)}-row matrix")
    ids = np.ascontiguousarray(rows, dtype=np.int64)
    x = np.ascontiguousarray(q, dtype=np.float32)
    out = np.empty(n, dtype=np.float32)
    by_ids = faiss.fvec_inner_products_by_idx if metric == "ip" else faiss.fvec_L2sqr_by_idx
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)  # this thread's setting (OpenMP keeps one per thread), restored below
    try:  # every array handed to FAISS is held by a name until the call returns (swig_ptr keeps none)
        by_ids(faiss.swig_ptr(out), faiss.swig_ptr(x), faiss.swig_ptr(matrix), faiss.swig_ptr(ids), dim, 1, n)
    finally:
        faiss.omp_set_num_threads(threads)
    return out


def nearest_lists(quantizer: faiss.Index, q: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` inverted lists nearest one query q (E,), in no order: the lists an IVF search
    visiting ``count`` of them scans. A flat quantizer's scores are FAISS's own (``fvec_*_ny``, as
    its search computes them) and the nearest are picked with ``np.argpartition``: about 45 us for
    1,920 of 4,096 lists, against 315 us for its search's heap, which also orders them."""
    import faiss

    flat = faiss.downcast_index(quantizer)
    if count >= flat.ntotal:
        return np.arange(flat.ntotal)
    if not isinstance(flat, (faiss.IndexFlatIP, faiss.IndexFlatL2)):
        return flat.search(np.ascontiguousarray(q[None, :], dtype=np.float32), count)[1][0]
    centroids = faiss.rev_swig_ptr(flat.get_xb(), flat.ntotal * flat.d)
    x = np.ascontiguousarray(q, dtype=np.float32)
    scores = np.empty(flat.ntotal, dtype=np.float32)
    largest = flat.metric_type == faiss.METRIC_INNER_PRODUCT
    by_list = faiss.fvec_inner_products_ny if largest else faiss.fvec_L2sqr_ny
    by_list(faiss.swig_ptr(scores), faiss.swig_ptr(x), faiss.swig_ptr(centroids), flat.d, flat.ntotal)
    return np.argpartition(-scores if largest else scores, count - 1)[:count]
