"""Column operations of the catalogue loop (puma.data.columns) equal Arrow's and Python's answers, on
chunked columns, and stay exact when the 64-bit string hashes collide (collisions forced)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from puma.data import columns

WORDS = ["", "a", "ab", "abcdefgh", "abcdefghi", "é", "日本", "x" * 30, "sku-1", "sku-10", "a\x00"]


@pytest.fixture(params=["hashed", "colliding"])
def hashes(request, monkeypatch):
    """The real hashes, or every string hashed to 0 (each answer must then come from the strings)."""
    if request.param == "colliding":
        monkeypatch.setattr(columns, "string_hashes", lambda values: np.zeros(len(values), np.uint64))
    return request.param


def _column(values: list[str], cuts: list[int]) -> pa.ChunkedArray:
    bounds = [0, *cuts, len(values)]
    pairs = zip(bounds, bounds[1:], strict=False)
    return pa.chunked_array([pa.array(values[a:b], pa.string()) for a, b in pairs])


def _values(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(WORDS) + str(rng.randrange(60)) for _ in range(n)]


def test_find_rows_is_index_in(hashes, monkeypatch):
    monkeypatch.setattr(columns, "JOIN_ROWS", 300)  # several steps
    values = _values(1200)
    wanted, keys = _column(values, [500, 501, 1000]), _column(values[::-7] + values[5:200], [100])
    expected = pc.index_in(wanted, value_set=keys).fill_null(-1).to_numpy(zero_copy_only=False)
    assert columns.find_rows(wanted, keys).tolist() == expected.tolist()
    assert columns.find_rows(wanted, pa.chunked_array([], pa.string())).tolist() == [-1] * len(values)


def test_first_rows_and_repeated_rows_are_pythons(hashes):
    values = _values(800, seed=1)
    numbers = np.arange(len(values)) % 3
    column = _column(values, [7, 400])
    first: dict = {}
    keyed = zip(values, numbers.tolist(), strict=True)
    expected = [first.setdefault(key, i) for i, key in enumerate(keyed)]
    assert columns.first_rows(column, numbers).tolist() == expected
    plain: dict = {}
    assert columns.first_rows(column).tolist() == [plain.setdefault(v, i) for i, v in enumerate(values)]
    counts = Counter(values)
    assert columns.repeated_rows(column).tolist() == [i for i, v in enumerate(values) if counts[v] > 1]


def test_take_and_scatter_rows_chunk_by_chunk():
    values = _values(500, seed=2)
    column = _column(values, [3, 3, 250])
    rows = np.random.default_rng(0).integers(0, 500, 300)
    assert columns.take_rows(column, rows).to_pylist() == [values[i] for i in rows]
    table = pa.table({"v": column, "n": pa.chunked_array([pa.array(np.arange(500))])})
    assert columns.take_rows(table, rows).column("n").to_pylist() == rows.tolist()
    where = np.array([0, 2, 3, 251, 499])
    out = columns.scatter_rows(column, where, pa.array([f"new{i}" for i in range(5)]))
    expected = list(values)
    for k, i in enumerate(where):
        expected[i] = f"new{k}"
    assert out.to_pylist() == expected


def test_string_hashes_are_equal_for_equal_strings_only():
    values = ["abcdefgh", "abcdefgh", "abcdefgh\x00", "abcdefghi", "", "a" * 17, "a" * 16 + "b"]
    hashed = columns.string_hashes(_column(values, [1, 4]))
    assert hashed[0] == hashed[1] and len(set(hashed.tolist())) == len(values) - 1
    big = pc.binary_join_element_wise("sku-", pa.array(np.arange(200_000)).cast(pa.string()), "")
    assert len(np.unique(columns.string_hashes(big))) == 200_000
