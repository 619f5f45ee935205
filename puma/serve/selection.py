"""What a query's filters select among a served index's items (puma.serve.live_index): its datasets,
catalogues (each named by URI or folder name) and metadata filter (puma.index.filters) as masks over
the index's held columns (a narrow number range as its rows), with the names no live item has (the
422s name them), and the live items' counts per dataset or catalogue (GET /stats).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from puma.index.filters import Filter, FilterError
from puma.index.search import ShardedIndex
from puma.index.table import CATALOGUE
from puma.inference.catalogue import catalogue_name
from puma.serve.errors import RequestError


def column_mask(index: ShardedIndex, column: str, names: tuple[str, ...],
                live: np.ndarray) -> tuple[np.ndarray | None, list]:
    """Items whose ``column`` is one of ``names`` (None: every item, when none are named), and the names
    no live item has."""
    if not names:
        return None, []
    present = set(live_counts(index, column))
    wanted = pa.array(names, pa.string())
    mask = np.concatenate([pc.is_in(values, value_set=wanted).fill_null(False).to_numpy(zero_copy_only=False)
                           for values in index.shard_columns(column)])  # (N,)
    return mask, [n for n in names if n not in present]


def catalogue_mask(index: ShardedIndex, names: tuple[str, ...],
                   live: np.ndarray) -> tuple[np.ndarray | None, list]:
    """Items of the named catalogues, each named by its URI or its folder name (None: every item, when
    none are named); and unknown names."""
    if not names:
        return None, []
    by_name = catalogue_names(index)
    uris = tuple(sorted({by_name[n] for n in names if n in by_name}))
    if names and not uris:  # only unknown names: no item (an empty name list means no filter)
        return np.zeros(index.ntotal, dtype=bool), list(names)
    mask, _ = column_mask(index, CATALOGUE, uris, live)
    return mask, [n for n in names if n not in by_name]


def catalogue_names(index: ShardedIndex) -> dict[str, str]:
    """Every name a live catalogue answers to (its URI and its folder name) -> its URI."""
    uris = list(live_counts(index, CATALOGUE))
    return {**{catalogue_short_name(u): u for u in uris}, **{u: u for u in uris}}


def live_counts(index: ShardedIndex, column: str) -> dict[str, int]:
    """Non-null values of a held string column over the live items -> how many have each, by name
    (shard by shard: a dictionary column counts its 4-byte codes, no string is copied)."""
    total: dict[str, int] = {}
    start = 0
    for values in index.shard_columns(column):
        live = pa.array(index.live[start:start + len(values)])
        start += len(values)
        for value, n in _counts(values.filter(live)).items():
            total[value] = total.get(value, 0) + n
    return dict(sorted(total.items()))


def named_filters(datasets, catalogues, columns=()) -> list[str]:
    """Filter names as one list, e.g. ["dataset 'cub'", "catalogue 'shop'", "column 'price'"]."""
    return [f"dataset {n!r}" for n in datasets] + [f"catalogue {n!r}" for n in catalogues] + \
        [f"column {n!r}" for n in columns]


def filter_mask(index: ShardedIndex, where: Filter | None, strict: bool) -> tuple[np.ndarray | None, list]:
    """Rows ``where`` selects (None: all, without a filter), and the columns it names that this index lacks.
    ``strict``: a 422 for an unknown column, a wrong type or value (the whole index is here). Else (one
    partition of several) unknown columns are returned, since another partition may hold them, and
    match nothing here; the known columns are still checked."""
    if where is None:
        return None, []
    types = index.filter_types
    unknown = sorted(c for c in where.columns() if c not in types)
    try:
        return index.filter_mask(where, unknown_ok=not strict), [] if strict else unknown
    except FilterError as exc:
        raise RequestError(422, str(exc)) from exc


def range_match(index: ShardedIndex, where: Filter | None) -> tuple[np.ndarray | None, int | None]:
    """What a number range ``where`` requires finds from the sorted columns (``IndexRows.range_match``):
    a narrow range's rows (ascending) and their count, a broader range's count alone, or (None, None)
    where it requires none or names a column this index lacks (evaluate it with ``filter_mask``)."""
    if where is None or not where.columns() <= index.filter_types.keys():
        return None, None
    try:
        return index.range_match(where)
    except FilterError as exc:
        raise RequestError(422, str(exc)) from exc


def first_look(index: ShardedIndex, where: Filter, strict: bool) -> tuple[float, np.ndarray | None,
                                                                          np.ndarray | None]:
    """A new filter's share of the live items, and what finding it left: (share, mask, rows). A narrow
    number range gives its rows, a broader one that is nothing but a range only its count (its hits are
    evaluated alone: ``range_match``); any other is evaluated on every row (``filter_mask``)."""
    rows, count = range_match(index, where)
    if count is None:
        mask, _ = filter_mask(index, where, strict)
        return np.count_nonzero(mask) / max(1, index.live_total), mask, None
    return count / max(1, index.live_total), None, rows


def _counts(column: pa.ChunkedArray) -> dict[str, int]:
    """Non-null string values of a column -> how many items have each, by name."""
    values = pc.value_counts(column.drop_null() if len(column) else pa.array([], pa.string()))
    pairs = [(v["values"], v["counts"]) for v in values.to_pylist()]
    return {str(value): int(count) for value, count in sorted(pairs) if value is not None}


def catalogue_short_name(uri: str) -> str:
    """A catalogue's folder name (puma.inference.catalogue), else its URI."""
    try:
        return catalogue_name(uri)
    except ValueError:
        return uri
