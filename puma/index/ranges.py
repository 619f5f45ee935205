"""A number range's rows without evaluating every row: each shard's number columns sorted once.

A filter that requires a range on a number column (``required_ranges``: a comparison ``eq``, ``gt``,
``gte``, ``lt`` or ``lte`` with a number, alone or among the parts of an ``and``) matches only rows
whose value lies in it. ``SortedColumn`` holds a shard's rows with a value, ordered by it, so the rows
in a range are one slice (two binary searches) instead of a comparison over every row and a scan of
the result. The slice holds at least the range's rows (an end the column's type cannot hold exactly
is taken closed). ``puma.index.rows.IndexRows.range_match`` takes them as they are (less removed rows)
where the filter is nothing but that range and the slice exact; else it evaluates the whole filter on
them alone, which keeps it exactly as ``filter_mask`` decides it.

A sorted column costs 4 bytes an item (the order, int32) plus the values' own width (8 for int64 and
float64), made at the first range filter on that column after its shard loads, kept with the loaded
shard. Measured at 1M items (bench/results/bench_filters.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from puma.index.filter_tree import And, Condition, Filter

RANGE_SHARE = 0.25  # a range holding more than this share of the rows is evaluated on every row: a
# slice's rows must be sorted and evaluated again, which costs more than the comparison past that
RANGE_OPS = ("eq", "gt", "gte", "lt", "lte")


@dataclass(frozen=True)
class Bounds:
    """Values from low to high (either end None: unbounded), each end open (excluded) or closed."""

    low: float | int | None = None
    high: float | int | None = None
    low_open: bool = False
    high_open: bool = False

    def within(self, other: Bounds) -> Bounds:
        """The intersection of two ranges."""
        low, low_open = _tighter((self.low, self.low_open), (other.low, other.low_open), 1)
        high, high_open = _tighter((self.high, self.high_open), (other.high, other.high_open), -1)
        return Bounds(low, high, low_open, high_open)


@dataclass(frozen=True)
class SortedColumn:
    """A shard's rows holding a number in one column, by value (NaN last)."""

    order: np.ndarray  # (m,) int32 rows (of the shard) with a value, ascending by it
    values: np.ndarray  # (m,) their values in that order
    numbers: int  # the values before the first NaN (all of them on integer columns)

    def span(self, bounds: Bounds) -> tuple[int, int, bool]:
        """Where the rows whose value may lie in ``bounds`` are in ``order`` (low, high), and whether
        they are exactly those (else a superset: an end the column's type cannot hold)."""
        low, low_exact = (0, True) if bounds.low is None else self._end(bounds.low, bounds.low_open, True)
        high, high_exact = (self.numbers, True) if bounds.high is None else \
            self._end(bounds.high, bounds.high_open, False)
        return low, max(low, high), low_exact and high_exact

    def _end(self, value: float | int, open_end: bool, low: bool) -> tuple[int, bool]:
        """Where a range's end lies among the values, and whether exactly (``_bound``)."""
        target, as_asked, exact = _bound(value, self.values.dtype, low)
        excluded = open_end and as_asked
        side = ("right" if excluded else "left") if low else ("left" if excluded else "right")
        return int(np.searchsorted(self.values[:self.numbers], target, side=side)), exact


def sorted_column(table: pa.Table, name: str) -> SortedColumn | None:
    """A shard filter table's column sorted (``SortedColumn``); empty where the table lacks it (its rows
    match no comparison); None where it is not an integer or float64/float32 column (evaluate it)."""
    if name not in table.column_names:
        return SortedColumn(np.zeros(0, np.int32), np.zeros(0, np.float64), 0)
    column = table.column(name)
    kind = column.type
    if not (pa.types.is_integer(kind) or pa.types.is_float32(kind) or pa.types.is_float64(kind)):
        return None
    values = column.to_numpy(zero_copy_only=False) if column.null_count == 0 else \
        column.fill_null(0).to_numpy(zero_copy_only=False)
    rows = np.arange(len(values), dtype=np.int32) if column.null_count == 0 else \
        np.flatnonzero(column.is_valid().to_numpy(zero_copy_only=False)).astype(np.int32)
    values = values[rows] if column.null_count else values
    by_value = np.argsort(values, kind="stable")
    values = values[by_value]
    numbers = len(values) - (int(np.isnan(values).sum()) if values.dtype.kind == "f" else 0)
    return SortedColumn(rows[by_value], values, numbers)


def required_ranges(where: Filter) -> dict[str, Bounds]:
    """The number ranges ``where`` requires, by column: of a comparison with a number, alone or a part
    of an ``and`` (nested ``and``s too); none from ``or`` and ``not``, which require no one range."""
    ranges: dict[str, Bounds] = {}
    for c in _required_conditions(where):
        if is_range(c):
            v = c.value
            bounds = Bounds(None if c.op in ("lt", "lte") else v, None if c.op in ("gt", "gte") else v,
                            c.op == "gt", c.op == "lt")
            ranges[c.column] = ranges[c.column].within(bounds) if c.column in ranges else bounds
    return ranges


def range_only(where: Filter, column: str) -> bool:
    """Whether ``where`` is nothing but a range on ``column`` (its rows are then the range's)."""
    parts = list(where.conditions())
    return len(_required_conditions(where)) == len(parts) and all(c.column == column and is_range(c)
                                                                  for c in parts)


def is_range(c: Condition) -> bool:
    """A comparison (eq, gt, gte, lt, lte) with a number (not NaN)."""
    return c.op in RANGE_OPS and isinstance(c.value, (int, float)) and not isinstance(c.value, bool) \
        and not (isinstance(c.value, float) and math.isnan(c.value))


def _required_conditions(where: Filter) -> list[Condition]:
    if isinstance(where, Condition):
        return [where]
    if isinstance(where, And):
        return [c for part in where.parts for c in _required_conditions(part)]
    return []


def _tighter(a: tuple, b: tuple, sign: int) -> tuple:
    """The tighter of two (bound, open) ends: the larger low end (sign 1) or the smaller high end (-1);
    of equal bounds the open one."""
    if a[0] is None or b[0] is None:
        return b if a[0] is None else a
    if a[0] == b[0]:
        return a[0], a[1] or b[1]
    return a if (a[0] - b[0]) * sign > 0 else b


def _bound(value: float | int, dtype: np.dtype, low: bool) -> tuple[float | int, bool, bool]:
    """A range's end as a column of ``dtype`` is searched for it: (the end, whether it is open or closed
    as asked, whether the slice it gives is exact). Where the type holds the end, as asked and exact;
    where it cannot (0.1 in a float32 column, an end beyond an integer type's values: its extreme),
    closed, a superset. On integers a fractional end is the next whole number inward, closed and exact
    (x > 2.5 is x >= 3)."""
    if dtype.kind not in "iu":
        held = bool(dtype.type(value) == value)
        return value, held, held
    info = np.iinfo(dtype)
    if isinstance(value, float):
        if math.isinf(value):
            return (info.min if value < 0 else info.max), False, False
        if not value.is_integer():
            return min(max(math.ceil(value) if low else math.floor(value), info.min), info.max), False, True
        value = int(value)
    if not info.min <= value <= info.max:
        return min(max(value, info.min), info.max), False, False
    return value, True, True
