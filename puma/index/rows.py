"""The rows of an opened index: its loaded shards' Parquet rows end to end, and what is stored for each.

Rows are numbered 0..ntotal-1 in shard order. They equal the FAISS global ids until a compaction
leaves a gap in the ids (``global_ids`` and back). A removed (tombstoned) row stays a row, with
``live`` False. ``IndexRows`` maps rows to shards, item ids, held or stored columns and embeddings, and
evaluates metadata filters over the shards' filter tables; ``puma.index.search.ShardedIndex`` adds
the search.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import pyarrow as pa

from puma.index import backend
from puma.index.filter_eval import evaluate
from puma.index.filtered import SAMPLE_ROWS, merged_description, merged_types, vector_scores
from puma.index.filters import Filter, check_filter
from puma.index.layout import IndexFolder
from puma.index.loaded import Holding, LoadedShard
from puma.index.lookup import hash_id, hash_ids
from puma.index.manifest import Manifest
from puma.index.plan import IndexInputError
from puma.index.ranges import RANGE_SHARE, range_only, required_ranges
from puma.index.table import EMBEDDING, ITEM_ID, embedding_matrix, read_columns, read_rows


class IndexRows:
    """The rows of an index's loaded shards (``loaded``, in the manifest's shard order, held as
    ``holding`` says)."""

    def __init__(self, uri: str, manifest: Manifest, loaded: list[LoadedShard], holding: Holding) -> None:
        self.uri, self.manifest, self.holding = uri, manifest, holding
        self._loaded = loaded
        self._starts = np.array([s.entry.id_start for s in loaded], dtype=np.int64)  # first global id
        counts = [s.entry.count for s in loaded]
        self._offsets = np.cumsum([0] + counts)[:-1].astype(np.int64)  # first row of each shard
        self._ntotal = int(sum(counts))
        self._gapless = bool(np.array_equal(self._starts, self._offsets))
        self.live = np.concatenate([s.live for s in loaded]) if loaded else np.zeros(0, bool)  # (N,) bool
        self.live_total = int(self.live.sum())

    def reused_shards(self, other: IndexRows) -> int:
        """How many of this index's loaded shards are the very objects ``other`` holds (refresh tests)."""
        theirs = {id(s) for s in other._loaded}
        return sum(id(s) in theirs for s in self._loaded)

    def cache_files(self) -> set[str]:
        """The files of ``holding.cache`` this index's shards use (columns, on-disk lists)."""
        return {name for s in self._loaded for name in s.files}

    def shard_columns(self, column: str) -> list[pa.Array]:
        """A column held in memory (``holding.columns``) as one array per shard, in row order (removed
        rows too)."""
        return [s.arrays[column] for s in self._loaded]

    @property
    def ntotal(self) -> int:
        """Rows (the length of ``live`` and of ``allowed`` masks), removed ones included."""
        return self._ntotal

    @property
    def dim(self) -> int:
        return self.manifest.dim

    @cached_property
    def filter_types(self) -> dict[str, str]:
        """The filterable columns and their types over every shard (``puma.index.filtered``)."""
        return merged_types(self._filter_tables())

    def filter_mask(self, where: Filter, unknown_ok: bool = False) -> np.ndarray:
        """Rows (N,) ``where`` selects, removed rows never; a FilterError names a column this index lacks
        (unless ``unknown_ok``: such a column matches nothing) or a value of the wrong type."""
        check_filter(where, self.filter_types, unknown_ok)
        tables = self._filter_tables()
        if not tables:
            return np.zeros(0, dtype=bool)
        return np.concatenate([evaluate(where, t) for t in tables]) & self.live

    def range_match(self, where: Filter) -> tuple[np.ndarray | None, int | None]:
        """What a number range ``where`` requires (``puma.index.ranges``) finds without evaluating every
        row, from each shard's sorted column: (rows, count) where the narrowest holds at most RANGE_SHARE
        of the rows (its rows, ascending, removed never, with ``where`` evaluated on them alone, not where
        it is nothing but that range and the slice is exact); (None, count) where ``where`` is nothing
        but a broader range the columns hold exactly (counted, not evaluated); else (None, None): evaluate
        it with ``filter_mask``. A FilterError as ``filter_mask`` raises it."""
        check_filter(where, self.filter_types)
        best = self._narrowest_range(where)
        if best is None:
            return None, None
        count, name, columns, spans = best
        only = range_only(where, name)
        if count <= RANGE_SHARE * self.ntotal:
            rows = self._range_rows(where, columns, spans, only)
            return rows, len(rows)
        if not only or not all(exact for _, _, exact in spans):
            return None, None
        return None, sum(high - low if shard.live.all() else
                         int(np.count_nonzero(np.take(shard.live, column.order[low:high])))
                         for shard, column, (low, high, _) in zip(self._loaded, columns, spans, strict=True))

    def _range_rows(self, where: Filter, columns: list, spans: list, only: bool) -> np.ndarray:
        """The live rows of each shard's span that ``where`` selects, ascending (``range_match``)."""
        found = []
        for shard, column, (low, high, exact), table, offset in zip(self._loaded, columns, spans,
                                                                    self._filter_tables(), self._offsets,
                                                                    strict=True):
            local = np.sort(column.order[low:high])
            keep = np.take(shard.live, local)
            if not (only and exact):  # the whole filter, on these rows alone
                keep &= evaluate(where, _named(table, where).take(pa.array(local)))
            found.append(local[keep].astype(np.int64) + offset)
        return np.concatenate(found)

    def _narrowest_range(self, where: Filter) -> tuple[int, str, list, list] | None:
        """Of the number ranges ``where`` requires, the one holding the fewest rows: (rows, column, each
        shard's sorted column, each shard's span); None where it requires none on a sorted column."""
        best = None
        for name, bounds in required_ranges(where).items():
            columns = [s.sorted_column(name) for s in self._loaded]
            if any(c is None for c in columns):
                continue
            spans = [c.span(bounds) for c in columns]
            count = sum(high - low for low, high, _ in spans)
            if best is None or count < best[0]:
                best = (count, name, columns, spans)
        return best

    def filter_share(self, where: Filter) -> float:
        """The share of live items ``where`` selects, estimated on a fixed sample of them (up to
        SAMPLE_ROWS drawn at random, the same for a state); a FilterError as ``filter_mask`` raises it
        (unknown columns match nothing)."""
        check_filter(where, self.filter_types, unknown_ok=True)
        sample = self._filter_sample
        return float(self.filter_at(where, sample).mean()) if len(sample) else 0.0

    @cached_property
    def _filter_sample(self) -> np.ndarray:
        live = np.flatnonzero(self.live)
        return np.sort(np.random.default_rng(0).choice(live, min(SAMPLE_ROWS, len(live)), replace=False))

    def filter_at(self, where: Filter, rows: np.ndarray) -> np.ndarray:
        """Which of rows (n,; -1: none) ``where`` selects, removed rows never: bool (n,), each shard's
        rows evaluated on its own filter table as ``filter_mask`` does."""
        rows = np.asarray(rows, dtype=np.int64)
        out = np.zeros(len(rows), dtype=bool)
        found = np.flatnonzero(rows >= 0)
        shard, local = self.locate(rows[found])
        tables = self._filter_tables()
        for s in np.unique(shard):
            at = shard == s
            out[found[at]] = evaluate(where, _named(tables[s], where).take(pa.array(local[at])))
        out[found] &= self.live[rows[found]]
        return out

    def describe_filters(self, max_values: int = 50) -> dict:
        """The filterable columns: their types and, for text columns with few values, the values."""
        return merged_description(self._filter_tables(), [s.live for s in self._loaded], max_values)

    def _filter_tables(self) -> list[pa.Table]:
        if not self.holding.filters:
            raise IndexInputError("this index was opened without its filter columns: open it with "
                                  "Holding(filters=True) to filter by metadata")
        return [s.filters for s in self._loaded]

    def vectors_at(self, rows: np.ndarray) -> np.ndarray:
        """The stored embeddings of rows (n,), ascending, as (n, E) float32: from the held embedding
        column (in memory or mapped from the column file), else read from the shards' Parquet."""
        shard, local = self.locate(rows)
        bounds = np.searchsorted(shard, np.arange(len(self._loaded) + 1))
        out = np.empty((len(rows), self.dim), dtype=np.float32)
        for s in np.flatnonzero(np.diff(bounds)):
            at = slice(bounds[s], bounds[s + 1])
            loaded = self._loaded[s]
            if loaded.holds(EMBEDDING):
                loaded.vectors(local[at], out[at])
            else:
                out[at] = embedding_matrix(self.rows(rows[at], [ITEM_ID, EMBEDDING]))
        return out

    def find(self, item_id: str) -> int:
        """The live row of one item id, -1 when the index does not hold it (a hash lookup)."""
        h = np.uint64(hash_id(item_id))
        for shard, offset in zip(self._loaded, self._offsets.tolist(), strict=True):
            row = shard.ids.find(item_id, h, shard.live, shard.item_id)
            if row >= 0:
                return offset + row
        return -1

    def lookup(self, item_ids: list[str] | np.ndarray) -> np.ndarray:
        """Item ids -> rows (int64); raises IndexInputError naming any that are not indexed (or removed)."""
        wanted = [str(x) for x in item_ids]
        hashes = hash_ids(pa.array(wanted, type=pa.string()))  # (n,)
        rows = np.full(len(wanted), -1, dtype=np.int64)
        for shard, offset in zip(self._loaded, self._offsets.tolist(), strict=True):
            todo = np.flatnonzero(rows < 0)
            if not len(todo):
                break
            found = shard.ids.find_many([wanted[i] for i in todo], hashes[todo], shard.live, shard.item_id)
            rows[todo[found >= 0]] = found[found >= 0] + offset
        if (rows < 0).any():
            missing = [wanted[i] for i in np.flatnonzero(rows < 0)[:10]]
            raise IndexInputError(f"{int((rows < 0).sum())} item id(s) are not in index {self.uri}, "
                                  f"e.g. {missing}")
        return rows

    def embeddings(self, item_ids: list[str] | np.ndarray) -> np.ndarray:
        """Stored embeddings of indexed items (n,) -> (n, E) float32 (see ``vector``)."""
        rows = self.lookup(item_ids)
        if len(rows) and all(s.holds(EMBEDDING) for s in self._loaded):
            return np.stack([self.vector(r) for r in rows.tolist()])
        return embedding_matrix(self.rows(rows, [ITEM_ID, EMBEDDING]))

    def scores_at(self, q: np.ndarray, rows: np.ndarray, metric: str) -> np.ndarray:
        """One query q (E,) scored in float32 against the stored embeddings of rows (n,), ascending: (n,)
        inner products ("ip") or squared distances ("l2"). Read in place where a shard holds its
        embeddings as a float32 matrix (``backend.scores_of_rows``: no gathered copy, on the calling
        thread), else from their gathered copy (``vectors_at``)."""
        shard, local = self.locate(rows)
        bounds = np.searchsorted(shard, np.arange(len(self._loaded) + 1))
        out = np.empty(len(rows), dtype=np.float32)
        for s in np.flatnonzero(np.diff(bounds)):
            at = slice(bounds[s], bounds[s + 1])
            loaded = self._loaded[s]
            matrix = loaded.matrix() if loaded.holds(EMBEDDING) else None
            if matrix is not None and matrix.dtype == np.float32 and matrix.flags.c_contiguous:
                out[at] = backend.scores_of_rows(matrix, q, local[at], metric)
            else:
                out[at] = vector_scores(self.vectors_at(rows[at]), q[None, :], metric == "ip")[0]
        return out

    def _to_rows(self, ids: np.ndarray) -> np.ndarray:
        """FAISS global ids (any shape, -1: none) -> rows (same shape, -1: none)."""
        if self._gapless:
            return ids
        flat = ids.ravel()
        shard = np.maximum(np.searchsorted(self._starts, flat, side="right") - 1, 0)
        rows = np.where(flat >= 0, self._offsets[shard] + flat - self._starts[shard], -1)
        return rows.reshape(ids.shape)

    def global_ids(self, rows: np.ndarray) -> np.ndarray:
        """Rows (n,) -> their FAISS global ids (n,): the same item's id in any subset of the shards."""
        rows = np.asarray(rows, dtype=np.int64)
        if self._gapless:
            return rows
        shard = np.searchsorted(self._offsets, rows, side="right") - 1
        return self._starts[shard] + rows - self._offsets[shard]

    def _id_mask(self, rows_mask: np.ndarray) -> np.ndarray:
        """A bool mask over rows -> the same selection as a mask over FAISS global ids."""
        if self._gapless:
            return rows_mask
        rows = np.flatnonzero(rows_mask)
        shard = np.searchsorted(self._offsets, rows, side="right") - 1
        mask = np.zeros(self.manifest.next_id, dtype=bool)
        mask[self._starts[shard] + rows - self._offsets[shard]] = True
        return mask

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows (n,) -> (the shard of each (n,), the row within it (n,))."""
        rows = np.asarray(rows, dtype=np.int64)
        shard = np.searchsorted(self._offsets, rows, side="right") - 1
        return shard, rows - self._offsets[shard]

    def to_item_ids(self, ids: np.ndarray) -> np.ndarray:
        """Rows (any shape, -1 for none) -> item ids (same shape, '' for none or removed)."""
        flat = np.asarray(ids, dtype=np.int64).ravel()
        names = np.full(len(flat), "", dtype=object)
        found = np.flatnonzero(flat >= 0)
        found = found[self.live[flat[found]]]
        shard, local = self.locate(flat[found])
        for s in np.unique(shard):
            at = shard == s
            names[found[at]] = self._loaded[s].item_ids_at(local[at])
        return names.reshape(np.shape(ids))

    def describe(self, rows: np.ndarray, columns: list[str]) -> list[dict]:
        """Held columns (in memory or in the column file) of some rows (n,) as n dicts of Python values:
        only those rows' fields are read (a hit list's k rows, not the columns)."""
        shard, local = self.locate(rows)
        loaded = self._loaded
        return [loaded[s].values(r, columns) for s, r in zip(shard.tolist(), local.tolist(), strict=True)]

    def vector(self, row: int) -> np.ndarray:
        """The stored embedding of one row (E,) float32: from the held embedding column when there is
        one (no Parquet read), else from the shard's Parquet."""
        shard, local = self.locate(np.array([row]))
        loaded = self._loaded[int(shard[0])]
        if loaded.holds(EMBEDDING):
            return np.array(loaded.values(int(local[0]), [EMBEDDING])[EMBEDDING], dtype=np.float32)
        return embedding_matrix(self.rows(np.array([row]), [ITEM_ID, EMBEDDING]))[0]

    def rows(self, ids: np.ndarray, columns: list[str]) -> pa.Table:
        """Stored columns of items by row (n,), in that order; a column a shard lacks is null."""
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids):
            return pa.table({name: pa.nulls(0) for name in columns})
        shard_of = np.searchsorted(self._offsets, ids, side="right") - 1  # (n,)
        parts, order = [], []
        for s in np.unique(shard_of):
            rows = np.flatnonzero(shard_of == s)
            entry = self.manifest.shards[s]
            part = read_rows(IndexFolder(self.uri).file(entry.embeddings.path), ids[rows] - self._offsets[s],
                             columns, missing_ok=True)
            parts.append(part)
            order.append(rows)
        table = pa.concat_tables(parts, promote_options="permissive")
        return table.take(pa.array(np.argsort(np.concatenate(order), kind="stable")))

    def table(self, columns: list[str], missing_ok: bool = False) -> pa.Table:
        """Stored columns of every row, removed ones included (see ``live``), in row order
        (``missing_ok``: absent columns are null)."""
        parts = [read_columns(IndexFolder(self.uri).file(shard.embeddings.path), columns, missing_ok)
                 for shard in self.manifest.shards]
        return pa.concat_tables(parts, promote_options="permissive")


def _named(table: pa.Table, where: Filter) -> pa.Table:
    """The columns of a shard's filter table that ``where`` names (the rest need not be taken)."""
    return table.select([c for c in table.column_names if c in where.columns()])
