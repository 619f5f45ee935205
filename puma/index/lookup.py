"""Item id -> row by hash: 64-bit FNV-1a hashes of a shard's item ids, sorted, with the row beside each.

Built once per shard (a few seconds for 10M ids, vectorised over the Arrow string buffers: every string
is hashed position by position, longest first, so each step works on a contiguous slice); a query hashes
its id in Python the same way, binary-searches the sorted hashes and checks the candidate row's id (two
ids may share a hash) and that the row is live (removed rows keep their ids until compaction). About 12
bytes per item (8 for the hash, 4 for the row).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa

FNV_OFFSET = np.uint64(0xCBF29CE484222325)
FNV_PRIME = np.uint64(0x100000001B3)
_MASK = (1 << 64) - 1


def hash_id(item_id: str) -> int:
    """The 64-bit FNV-1a hash of one id's UTF-8 bytes (equals ``hash_ids`` of it)."""
    h, prime = int(FNV_OFFSET), int(FNV_PRIME)
    for byte in item_id.encode():
        h = ((h ^ byte) * prime) & _MASK
    return h


def hash_ids(ids: pa.Array) -> np.ndarray:
    """FNV-1a hashes of a string array's values: (n,) -> (n,) uint64 (a null hashes as '')."""
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    if pa.types.is_large_string(ids.type):
        width = np.int64
    elif pa.types.is_string(ids.type):
        width = np.int32
    else:
        raise TypeError(f"item ids must be strings, got {ids.type}")
    n = len(ids)
    _, offsets_buf, data_buf = ids.buffers()
    skip = ids.offset * np.dtype(width).itemsize  # a sliced array starts inside the buffer
    offsets = np.frombuffer(offsets_buf, dtype=width, count=n + 1, offset=skip)  # (n+1,)
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offsets).astype(np.int64)  # (n,) 0 for nulls
    order = np.argsort(-lengths, kind="stable")  # longest first: the strings still going are a prefix
    starts, sorted_lengths = offsets[:-1][order].astype(np.int64), lengths[order]
    going = np.bincount(sorted_lengths, minlength=1)[::-1].cumsum()[::-1]  # going[p]: strings of >= p bytes
    h = np.full(n, FNV_OFFSET, dtype=np.uint64)
    for pos in range(int(sorted_lengths[0]) if n else 0):
        m = int(going[pos + 1]) if pos + 1 < len(going) else 0  # strings with a byte at pos
        part = h[:m]
        part ^= data[starts[:m] + pos]
        part *= FNV_PRIME  # wraps modulo 2**64
    out = np.empty(n, dtype=np.uint64)
    out[order] = h
    return out


class IdLookup:
    """One shard's item ids, findable by hash: sorted hashes (n,) uint64 and their rows (n,) uint32.
    The ids themselves stay where the shard keeps them: a search checks a candidate with ``id_at``."""

    def __init__(self, ids: pa.Array) -> None:
        hashes = hash_ids(ids)
        self.rows = np.argsort(hashes, kind="stable").astype(np.uint32 if len(ids) < 2**32 else np.int64)
        self.hashes = hashes[self.rows]

    @property
    def nbytes(self) -> int:
        return self.hashes.nbytes + self.rows.nbytes

    def find(self, item_id: str, h: np.uint64, live: np.ndarray, id_at: Callable[[int], str]) -> int:
        """The live row holding ``item_id`` (``h``: its hash_id), -1 when there is none."""
        i = int(np.searchsorted(self.hashes, h))
        while i < len(self.hashes) and self.hashes[i] == h:
            row = int(self.rows[i])
            if live[row] and id_at(row) == item_id:
                return row
            i += 1
        return -1

    def find_many(self, wanted: list[str], hashes: np.ndarray, live: np.ndarray,
                  id_at: Callable[[int], str]) -> np.ndarray:
        """Live rows of many ids (m,) with their hashes (m,) -> (m,) int64, -1 where this shard has none."""
        found = np.full(len(hashes), -1, dtype=np.int64)
        pos = np.searchsorted(self.hashes, hashes)  # (m,) first candidate of each
        todo = np.arange(len(hashes))
        while len(todo):
            p = pos[todo]
            todo, p = todo[p < len(self.hashes)], p[p < len(self.hashes)]
            same = self.hashes[p] == hashes[todo]
            todo, p = todo[same], p[same]
            rows = self.rows[p].astype(np.int64)
            ok = np.array([bool(live[r]) and id_at(int(r)) == wanted[i]
                           for i, r in zip(todo.tolist(), rows.tolist(), strict=True)], dtype=bool)
            found[todo[ok]] = rows[ok]
            todo = todo[~ok]  # a hash collision or a removed row: try the next equal hash
            pos[todo] += 1
        return found
