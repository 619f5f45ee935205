"""What a filtered search needs from the index: each shard's filter table, the columns' types over all
shards, and how far an IVF search must look to return an exact filtered top-k.

A shard's filter table (``filter_table``) holds the built-in columns dataset, catalogue, label and
class_name and the metadata's typed columns (``puma.index.metadata.metadata_columns``: a catalogue
table's other columns, numbers as numbers, true/false as booleans). A CSV table's cells are stored
as text, so a text column whose every value is a plain number (``-12``, ``4.5``, ``1e3``; no leading
zero, so ``02134`` stays text) is a number column, and one of only ``true`` and ``false`` a boolean
column (``typed_text``). A metadata key named like a built-in column is shadowed by it. String columns
whose values repeat are dictionary-encoded, so a category or brand costs a byte or two per item.

Few selected rows (``brute_force``: at most ``BRUTE_FORCE_VALUES`` rows x dimensions) are scanned
exactly (``ranked_topk``): their stored embeddings are scored where they lie (``IndexRows.scores_at``:
FAISS on the replica's memory-mapped column file or held column; else gathered from the shards'
Parquet), the best 2k + 8 gathered and ranked in float64, whatever the index type, so a selective
filter costs what it selects, not what the index holds. On IVF, where the lists
an IVF search with the selection would visit (``filtered_nprobe``, below) are fewer than all, only
the selected rows in those lists nearest the query are gathered and ranked (``near_rows``: the same
candidates that search meets; each row's list is kept per loaded shard at 2 bytes an item, reused by
a refresh that keeps the shard, and 2 more in the state's copy): the gather is most of a scan's
time. A repeated filter's rows, whose embeddings its cached selection holds, are all ranked.

Exactness on IVF (``filtered_nprobe``), for larger selections: a filter that keeps a fraction f of the
items leaves about f of each inverted list's items, so a search that visits nprobe / f lists meets as
many matching candidates as an unfiltered search visiting nprobe lists. Below ``POST_FILTER_SHARE`` it
visits ``NARROW_WIDEN`` times as many: on clustered data the filtered top k lie further out. Once
that is most of the lists (``FULL_SCAN_SHARE``), the search visits every list: with the selector it
computes distances only for the selected items, an exact scan of them (on IVF-Flat the lists hold the
vectors themselves). A search that still returns fewer hits than items match (a filter concentrated
far from the query) is run again over every list (``ShardedIndex.search_ids``), so an answer holds k
hits whenever k items match.

A broad filter (``POST_FILTER_SHARE`` of the items or more, estimated on a sample) needs no selection
(``ShardedIndex.search_post_filtered``): an unfiltered search for ``POST_FILTER_MARGIN`` x k / share
hits over the lists the search with the selection would visit (``filtered_nprobe``), whose rows the
filter is then evaluated on. Whenever k of them pass, they are the k best selected items among those
the search visits (a better selected item would rank among the hits too): the answer of the search
with the selection. When fewer pass, the selection is made as above.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from puma.index import backend
from puma.index.cache import as_dictionary
from puma.index.filter_eval import column_types, describe_columns
from puma.index.metadata import metadata_columns
from puma.index.table import CATALOGUE, CLASS_NAME, DATASET, LABEL, METADATA

BUILT_IN = (DATASET, CATALOGUE, LABEL, CLASS_NAME)  # filterable on every index
SOURCE_COLUMNS = (*BUILT_IN, METADATA)  # what a shard's filter table is made from
FULL_SCAN_SHARE = 0.8  # visit every list once nprobe / fraction reaches this share of them: measured, the
# share where visiting nprobe / f lists costs as much as every list (bench/results/bench_filters.md)
BRUTE_FORCE_VALUES = 5_000_000  # a selection of at most this many rows x dimensions is scanned exactly:
# measured where the scan (then: about 80 ns a row to gather a 64-d embedding, then numpy) cost as much as
# FAISS with the selection, about 80,000 rows at 64-d of a 1M-item IVF index; the in-place scan is faster
# than FAISS up to 20% at least (bench/results/bench_filters.md), see docs/performance.md
POST_FILTER_SHARE = 0.4  # a filter keeping at least this share of the items (estimated on SAMPLE_ROWS
# of them) filters the hits of an unfiltered search of POST_FILTER_MARGIN x k / share items: measured at
# 1M items, such a search over nprobe / share lists (40 hits at 50%) holds the filtered top 10 with
# recall@10 0.9995 in 2.0 ms against 3.2 ms for the selection with FAISS; below 40% the hits needed
# (k / share) and the lists grow together (docs/performance.md)
POST_FILTER_MARGIN = 2.0
NARROW_WIDEN = 1.5  # a narrower filter's search visits this many times nprobe / f lists: on clustered
# data a filter's top k lie as far as the unfiltered top k / f, which nprobe / f lists hold less often
# than nprobe lists hold the top k (measured at 1M items, 5%: recall@10 0.989 over nprobe / f lists,
# 0.9955 at 1.25x, 0.9995 at 1.5x, 1.0 at 2x; bench/results/bench_filters.md)
SAMPLE_ROWS = 4096  # live rows a filter is evaluated on to estimate its share
DICTIONARY_SHARE = 0.5  # a string column is dictionary-encoded when its distinct values are below this share


def filter_table(columns: pa.Table) -> pa.Table:
    """A shard's filter table from its stored columns (``SOURCE_COLUMNS``; absent ones null)."""
    have, n = columns.column_names, columns.num_rows
    built_in = {name: _compact(columns.column(name)) if name in have else pa.nulls(n, pa.string())
                for name in BUILT_IN}
    meta = metadata_columns(columns.column(METADATA)) if METADATA in columns.column_names else pa.table({})
    extra = {name: _compact(typed_text(meta.column(name)))
             for name in meta.column_names if name not in built_in}
    return pa.table({**built_in, **extra})


PLAIN_NUMBER = r"^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?$"
PLAIN_INTEGER = r"^-?(0|[1-9][0-9]{0,17})$"  # fits int64


def typed_text(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    """A text column of plain numbers as numbers (int64 when every value is an integer), of only "true"
    and "false" as booleans; any other column as it is. Nulls stay null."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    text = pa.types.is_string(array.type) or pa.types.is_large_string(array.type)
    if not text or array.null_count == len(array):
        return array
    values = array.drop_null()
    if pc.all(pc.match_substring_regex(values, PLAIN_NUMBER)).as_py():
        whole = pc.all(pc.match_substring_regex(values, PLAIN_INTEGER)).as_py()
        return array.cast(pa.int64() if whole else pa.float64())
    if pc.all(pc.is_in(values, value_set=pa.array(["true", "false"]))).as_py():
        return pc.equal(array, "true")
    return array


def _compact(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    """One chunk; a string column of repeated values dictionary-encoded."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    if (pa.types.is_string(array.type) or pa.types.is_large_string(array.type)) and len(array):
        distinct = pc.count_distinct(array).as_py()
        if distinct < DICTIONARY_SHARE * len(array):
            return as_dictionary(array)
    return array


def merged_types(tables: list[pa.Table]) -> dict[str, str]:
    """Column -> type over every shard: one type where the shards agree; "json" where any shard holds
    nested values; "string" where they disagree otherwise (e.g. a size that is a number in one catalogue
    and text in another: filtered as text, the shards holding numbers match no text value)."""
    seen: dict[str, set[str]] = {}
    for table in tables:
        for name, kind in column_types(table).items():
            if not _all_null(table.column(name)):
                seen.setdefault(name, set()).add(kind)
    for name in BUILT_IN:
        seen.setdefault(name, {"number" if name == LABEL else "string"})
    return {name: merged_type(kinds) for name, kinds in sorted(seen.items())}


def merged_type(kinds: set[str]) -> str:
    """A column's one type from the types its shards (or partitions) give it (``merged_types``' rule)."""
    return next(iter(kinds)) if len(kinds) == 1 else "json" if "json" in kinds else "string"


def merged_description(tables: list[pa.Table], live: list[np.ndarray], max_values: int = 50) -> dict:
    """``GET /stats``' filterable columns: per column its type (``merged_types``) and, for a string column
    with at most ``max_values`` distinct values among the live items, those values (sorted)."""
    out = {name: {"type": kind} for name, kind in merged_types(tables).items()}
    for name, info in out.items():
        if info["type"] == "string":
            values = _few_values(name, tables, live, max_values)
            if values is not None:
                info["values"] = values
    return out


def _few_values(name: str, tables: list[pa.Table], live: list[np.ndarray], most: int) -> list | None:
    """The distinct text values of a column over the live items, None when there are more than ``most``."""
    distinct: set = set()
    for table, keep in zip(tables, live, strict=True):
        if name not in table.column_names:
            continue
        info = describe_columns(table.select([name]).filter(pa.array(keep)), most)[name]
        if info["type"] != "string":
            continue
        if "values" not in info or len(distinct.union(info["values"])) > most:
            return None
        distinct.update(info["values"])
    return sorted(distinct)


def filtered_nprobe(nprobe: int, nlist: int, selected: int, live: int) -> int:
    """The lists an IVF search with a filter keeping ``selected`` of ``live`` items visits (see the
    module docstring): nprobe / fraction (NARROW_WIDEN times that below POST_FILTER_SHARE), or every list
    once that reaches FULL_SCAN_SHARE of them."""
    if selected >= live or live <= 0:
        return min(nprobe, nlist)
    if selected <= 0:
        return nlist
    widen = NARROW_WIDEN if selected < POST_FILTER_SHARE * live else 1.0
    wanted = math.ceil(nprobe * widen * live / selected)
    return nlist if wanted >= FULL_SCAN_SHARE * nlist else wanted


def _all_null(column: pa.ChunkedArray) -> bool:
    return column.null_count == len(column)


def brute_force(selected: int, dim: int) -> bool:
    """Whether a search among ``selected`` rows scans their vectors exactly instead of asking FAISS
    (``BRUTE_FORCE_VALUES``)."""
    return selected * dim <= BRUTE_FORCE_VALUES


def near_rows(row_lists: np.ndarray, probed: np.ndarray, nlist: int) -> np.ndarray:
    """Which rows lie in the probed lists: bool (n,) from each row's list (n,) and the lists (m,; -1
    pads)."""
    near = np.zeros(nlist + 1, dtype=bool)  # the last entry: list -1, near no query
    near[probed[probed >= 0]] = True
    return np.take(near, row_lists)  # a third of the time of near[row_lists] with int16 lists


def exact_topk(vectors: np.ndarray, rows: np.ndarray, q: np.ndarray, k: int,
               metric: str) -> tuple[np.ndarray, np.ndarray]:
    """The exact top-k of queries (Q, E) among rows (n,) ascending, with their vectors (n, E): (Q, k)
    scores (inner products for "ip", squared distances for "l2", as FAISS gives them) and rows, best
    first, equal scores in row order; -1 pads (score -inf for ip, +inf for l2) when n < k."""
    return ranked_topk(first_scores(vectors, q, metric), rows, q, k, metric, lambda at: vectors[at])


def first_scores(vectors: np.ndarray, q: np.ndarray, metric: str) -> np.ndarray:
    """(Q, n) float32 scores of queries (Q, E) against vectors (n, E): one query through FAISS on the
    calling thread (``backend.scores_of_rows``, as a scan's reads; numpy's product starts OpenBLAS's
    threads, which spin on for a while after it and took the cores from FAISS's: p99 up to 40 ms at
    1M), more with numpy's matrix product."""
    if len(q) == 1 and vectors.dtype == np.float32 and vectors.flags.c_contiguous and len(vectors):
        return backend.scores_of_rows(vectors, q[0], np.arange(len(vectors)), metric)[None, :]
    return vector_scores(vectors, q, metric == "ip")


def ranked_topk(scores: np.ndarray, rows: np.ndarray, q: np.ndarray, k: int, metric: str,
                vectors_at: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``exact_topk`` from every row's float32 scores (Q, n) (``vector_scores``, or
    ``IndexRows.scores_at``): each query's best 2k + 8 are scored again in float64 from their vectors
    (``vectors_at``: positions (m,) ascending -> (m, E)) and ranked by that, so a row's score and rank
    do not depend on which other rows were scanned with it (an index partition scans its own share
    of the selected rows)."""
    largest = metric == "ip"
    take = min(k, len(rows))
    out_scores = np.full((len(q), k), -np.inf if largest else np.inf, dtype=np.float32)
    out_rows = np.full((len(q), k), -1, dtype=np.int64)
    if not len(rows):
        return out_scores, out_rows
    shortlist = np.sort(_best(scores, min(len(rows), 2 * k + 8), largest), axis=1)  # (Q, m)
    exact = np.stack([vector_scores(vectors_at(s).astype(np.float64), qi[None, :].astype(np.float64),
                                    largest)[0] for s, qi in zip(shortlist, q, strict=True)])
    key = -exact if largest else exact
    order = np.lexsort((np.take(rows, shortlist), key), axis=-1)[:, :take]  # by score, then row
    out_scores[:, :take] = np.take_along_axis(exact, order, axis=1)
    out_rows[:, :take] = rows[np.take_along_axis(shortlist, order, axis=1)]
    return out_scores, out_rows


def vector_scores(vectors: np.ndarray, q: np.ndarray, largest: bool) -> np.ndarray:
    """(Q, n) inner products (``largest``), or squared distances, of queries (Q, E) and vectors (n, E),
    in the inputs' precision."""
    products = q @ vectors.T
    if largest:
        return products
    norms = np.einsum("ij,ij->i", vectors, vectors)[None, :], np.einsum("ij,ij->i", q, q)[:, None]
    return norms[0] - 2 * products + norms[1]


def _best(scores: np.ndarray, m: int, largest: bool) -> np.ndarray:
    """The positions (Q, m) of each row's m best scores, in no order."""
    if m >= scores.shape[1]:
        return np.broadcast_to(np.arange(scores.shape[1]), scores.shape).copy()
    return np.argpartition(-scores if largest else scores, m - 1, axis=1)[:, :m]
