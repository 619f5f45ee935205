"""Column operations for tables of millions of rows, in bounded memory (catalogue listing and planning).

- ``take_rows`` / ``scatter_rows``: Arrow's ``take`` concatenates a chunked column first (a copy of
  all of it to pick a few rows); these work chunk by chunk.
- ``string_hashes``: a 64-bit hash of every string of a column, vectorised with numpy over 8-byte
  words (about a second for 10M short ids): 8 bytes a row, where Arrow's hash kernels (``index_in``,
  ``value_counts``) build a memo table of about 70 bytes a row (0.7 GB for 10M ids).
- ``find_rows`` (a join on string keys) and ``repeated_rows`` (duplicate keys) on those hashes, every
  match then checked on the strings themselves: exact whatever the hashes collide on.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

Column = pa.Array | pa.ChunkedArray
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's finaliser
_SEED = np.uint64(0x9E3779B97F4A7C15)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
JOIN_ROWS = 1 << 20  # references looked up per step (the step's temporaries: ~40 bytes a row)


def take_rows(values: pa.Table | Column, rows: np.ndarray) -> pa.Table | pa.Array:
    """``values.take(rows)``, chunk by chunk for a chunked column (or every column of a table)."""
    if isinstance(values, pa.Table):
        return pa.table({name: take_rows(values[name], rows) for name in values.column_names})
    rows = np.asarray(rows, np.int64)
    if isinstance(values, pa.Array) or values.num_chunks == 1:
        return (values if isinstance(values, pa.Array) else values.chunk(0)).take(pa.array(rows))
    starts = np.cumsum([0] + [len(c) for c in values.chunks])
    chunk_of = np.searchsorted(starts, rows, side="right") - 1
    order = np.argsort(chunk_of, kind="stable")
    bounds = np.searchsorted(chunk_of[order], np.arange(values.num_chunks + 1))
    parts = [values.chunk(k).take(pa.array(rows[order[a:b]] - starts[k]))
             for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)) if b > a]
    taken = pa.concat_arrays(parts) if parts else pa.array([], values.type)
    back = np.empty(len(rows), np.int64)
    back[order] = np.arange(len(rows))
    return taken.take(pa.array(back))


def scatter_rows(base: Column, where: np.ndarray, values: pa.Array) -> Column:
    """``base`` (strings) with ``values`` at the positions ``where`` (sorted); chunk by chunk when chunked."""
    if isinstance(base, pa.ChunkedArray):
        starts = np.cumsum([0] + [len(c) for c in base.chunks])
        cut = np.searchsorted(where, starts)
        parts = zip(base.chunks, starts[:-1], cut[:-1], cut[1:], strict=True)
        return pa.chunked_array([scatter_rows(c, where[a:b] - s, values.slice(a, b - a)) if b > a else c
                                 for c, s, a, b in parts], pa.string())
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    source = np.arange(len(base), dtype=np.int64)
    source[where] = len(base) + np.arange(len(where), dtype=np.int64)
    return pa.concat_arrays([base.cast(pa.string()), values.cast(pa.string())]).take(pa.array(source))


def string_hashes(values: Column) -> np.ndarray:
    """(N,) uint64: a hash of each string (null as ''); equal strings hash equal."""
    chunks = values.chunks if isinstance(values, pa.ChunkedArray) else [values]
    parts = [_hash_chunk(c if c.type == pa.string() else c.cast(pa.string())) for c in chunks if len(c)]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint64)


def _hash_chunk(chunk: pa.Array) -> np.ndarray:
    """Each string's bytes mixed 8 at a time: one numpy pass per 8 bytes of the longest string."""
    offsets = np.frombuffer(chunk.buffers()[1], np.int32)[chunk.offset:chunk.offset + len(chunk) + 1]
    offsets = offsets.astype(np.int64)
    lengths = np.diff(offsets)
    if chunk.null_count:
        lengths[~chunk.is_valid().to_numpy(zero_copy_only=False)] = 0
    text = np.zeros(int(offsets[-1] - offsets[0]) + 8, np.uint8)  # 8 zero bytes: every word in bounds
    if len(text) > 8:
        text[:-8] = np.frombuffer(chunk.buffers()[2], np.uint8)[offsets[0]:offsets[-1]]
    words = np.ndarray((len(text) - 7,), "<u8", text, 0, (1,))  # the 8 bytes from each byte on
    start = offsets[:-1] - offsets[0]
    hashes = _mix(lengths.astype(np.uint64) ^ _SEED)
    for k in range(0, int(lengths.max(initial=0)), 8):
        rows = np.flatnonzero(lengths > k)
        left = np.minimum(lengths[rows] - k, 8).astype(np.uint64)
        word = words[start[rows] + k] & (_ALL >> (np.uint64(64) - np.uint64(8) * left))
        hashes[rows] = _mix(hashes[rows] ^ word)
    return hashes


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def find_rows(wanted: Column, keys: Column) -> np.ndarray:
    """(len(wanted),) int32 (int64 past 2**31 keys): for each wanted string, the first row of ``keys``
    equal to it, else -1 (what ``pc.index_in`` gives), in about 12 bytes a key instead of a memo table."""
    key_hash, order = _sorted_hashes(string_hashes(keys))
    found = np.full(len(wanted), -1, order.dtype)
    for lo in range(0, len(wanted), JOIN_ROWS):
        part = wanted.slice(lo, JOIN_ROWS)
        hashes = string_hashes(part)
        sort = np.argsort(hashes)  # sorted needles: numpy's binary search narrows from the last one (10x)
        at = np.empty(len(hashes), np.int64)
        at[sort] = np.minimum(np.searchsorted(key_hash, hashes[sort]), max(len(key_hash) - 1, 0))
        hit = np.flatnonzero(key_hash[at] == hashes) if len(key_hash) else np.zeros(0, np.int64)
        same = _equal(take_rows(part, hit), take_rows(keys, order[at[hit]]))
        found[lo + hit[same]] = order[at[hit[same]]]
        for i in hit[~same]:  # hashes equal, strings not: the other keys of that hash, one by one
            found[lo + i] = _first_equal(part[int(i)].as_py(), keys, key_hash, order, hashes[i])
    return found


def _first_equal(value: str, keys: Column, key_hash: np.ndarray, order: np.ndarray, h: np.uint64) -> int:
    """The first row of ``keys`` equal to ``value`` among those of hash ``h`` (-1 when none)."""
    rows = np.sort(order[np.searchsorted(key_hash, h):np.searchsorted(key_hash, h, side="right")])
    return next((int(r) for r in rows if keys[int(r)].as_py() == value), -1)


def first_rows(values: Column, numbers: np.ndarray | None = None) -> np.ndarray:
    """(N,) int64: for each row, the first row holding the same string (and the same ``numbers`` entry,
    when given): itself when it is the first."""
    hashes, order = _sorted_hashes(_keyed_hashes(values, numbers))
    run = np.arange(len(order), dtype=order.dtype)  # each sorted row's run start (the run of its hash)
    run[1:][hashes[1:] == hashes[:-1]] = 0
    np.maximum.accumulate(run, out=run)
    first = np.empty(len(order), np.int64)
    first[order] = order[run]
    del run
    check = np.flatnonzero(first != np.arange(len(first)))
    same = np.concatenate([np.zeros(0, bool)] + [  # a step at a time: the strings compared, bounded
        _equal(take_rows(values, part), take_rows(values, first[part]))
        for part in np.array_split(check, max(1, len(check) // JOIN_ROWS))])
    if numbers is not None:
        same &= np.asarray(numbers)[check] == np.asarray(numbers)[first[check]]
    for i in check[~same]:  # a hash shared by different rows: the first truly equal row, one by one
        h = _keyed_hashes(values.slice(int(i), 1), None if numbers is None else np.asarray(numbers)[i:i + 1])
        rows = order[np.searchsorted(hashes, h[0]):np.searchsorted(hashes, h[0], side="right")]
        first[i] = _first_same(values, numbers, rows, int(i))
    return first


def _keyed_hashes(values: Column, numbers: np.ndarray | None) -> np.ndarray:
    hashes = string_hashes(values)
    if numbers is not None:
        hashes = _mix(hashes ^ _mix(np.asarray(numbers).astype(np.uint64) ^ _SEED))
    return hashes


def _sorted_hashes(hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the hashes sorted, in place; the rows in that order, equal hashes in row order, 4 bytes each
    where they fit)."""
    order = np.argsort(hashes, kind="stable")
    hashes.sort(kind="stable")
    return hashes, order.astype(np.int32) if len(order) < 2 ** 31 else order


def _first_same(values: Column, numbers: np.ndarray | None, rows: np.ndarray, i: int) -> int:
    """The first of ``rows`` (row ``i`` among them) holding what row ``i`` holds."""
    def key(r: int) -> tuple:
        return values[r].as_py(), None if numbers is None else int(numbers[r])
    return min(int(r) for r in rows if r <= i and key(int(r)) == key(i))


def repeated_rows(values: Column) -> np.ndarray:
    """Sorted positions of the rows whose string is on another row too (every copy, the first included)."""
    sorted_hashes, order = _sorted_hashes(string_hashes(values))
    twin = np.zeros(len(order), bool)
    twin[1:] = sorted_hashes[1:] == sorted_hashes[:-1]
    twin[:-1] |= twin[1:]
    candidates = np.sort(order[twin])  # same hash as another row: the strings decide
    if not len(candidates):
        return candidates
    texts = take_rows(values, candidates).to_pylist()
    counts: dict = {}
    for text in texts:
        counts[text] = counts.get(text, 0) + 1
    return candidates[np.array([counts[t] > 1 for t in texts], bool)]


def _equal(a: pa.Array, b: pa.Array) -> np.ndarray:
    return pc.equal(a.cast(pa.string()), b.cast(pa.string())).fill_null(False).to_numpy(zero_copy_only=False)
