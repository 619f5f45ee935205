"""The columnar table reader gives exactly what the per-row reader it replaced gave: the same rows, the
same rejects with their messages, and the metadata JSON byte for byte (an index compares it with the
JSON it stored, so one differing byte would make every item look changed after an upgrade).

``reference_read`` below is the per-row implementation as it was (parse to Python values, then one
``json.dumps`` per row); the tables are built to be hostile: unicode, quotes, backslashes, control
characters, numbers of every shape (integral, tiny, huge, negative zero, NaN, infinities, float32),
booleans, nulls, blanks, nested values, dates, duplicate, empty and typed ids, relative paths with
``.`` and ``..``, ``~``, ``file://`` and s3:// URIs.
"""

from __future__ import annotations

import csv
import datetime
import decimal
import json
import math
import os
import posixpath
import random
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from puma import storage
from puma.data.rejects import Reject
from puma.data.tables import ROWS_SCHEMA, json_column, read_item_table, table_stem

# ----------------------------------------------------------------------------- the per-row reference


def reference_read(uri: str, dataset: str = "") -> tuple[list[dict], list[dict], list[str]]:
    """(rows, rejects, metadata columns) as the per-row reader computed them."""
    uri = storage.absolute(uri)
    columns, lines = _ref_parse(uri)
    meta = [c for c in columns if c not in ("item_id", "image_uri", "label", "dataset")]
    if not columns and not lines:
        return [], [], []
    ids = [_ref_text(v) for v in columns["item_id"]]
    datasets = [_ref_text(v) or dataset or table_stem(uri) for v in columns.get("dataset", [None] * len(ids))]
    folder = posixpath.dirname(uri) if storage.is_s3(uri) else os.path.dirname(uri)
    images = [_ref_resolve(t, folder) if t else "" for t in map(_ref_text, columns["image_uri"])]
    problems: dict[int, tuple[str, str]] = {}
    for i, (item_id, image) in enumerate(zip(ids, images, strict=True)):
        if not item_id:
            problems[i] = ("empty_item_id", "item_id is empty")
        elif not image:
            problems[i] = ("missing_image_uri", f"image_uri of item {item_id!r} is empty")
    rows_of: dict[str, list[int]] = defaultdict(list)
    for i, item_id in enumerate(ids):
        if i not in problems:
            rows_of[item_id].append(i)
    for item_id, rows in rows_of.items():
        numbers = ", ".join(str(lines[i]) for i in rows)
        for i in rows[1:]:
            problems[i] = ("duplicate_item_id", f"item_id {item_id!r} is on rows {numbers}; the first "
                                                f"(row {lines[rows[0]]}) is kept")
    rejects = [Reject(ids[i] or f"<row {lines[i]}>", datasets[i], reason, "catalogue", images[i],
                      detail=f"{uri} row {lines[i]}: {detail}").to_dict() for i, (reason, detail) in
               sorted(problems.items())]
    keep = [i for i in range(len(ids)) if i not in problems]
    labels, names = _ref_labels([columns.get("label", [None] * len(ids))[i] for i in keep],
                                [datasets[i] for i in keep])
    rows = [{"item_id": ids[i], "image_uri": images[i], "label": labels[k], "class_name": names[k],
             "dataset": datasets[i], "source_row": lines[i],
             "metadata": json.dumps({n: _ref_safe(columns[n][i]) for n in meta}, sort_keys=True,
                                    allow_nan=False)} for k, i in enumerate(keep)]
    return rows, rejects, meta


def _ref_parse(uri: str) -> tuple[dict[str, list], list[int]]:
    data = storage.read_bytes(uri)
    if uri.endswith(".csv"):
        names = pacsv.open_csv(pa.BufferReader(data)).schema.names
        options = pacsv.ConvertOptions(column_types={n: pa.string() for n in names}, strings_can_be_null=True,
                                       null_values=[""], quoted_strings_can_be_null=False)
        table = pacsv.read_csv(pa.BufferReader(data), convert_options=options)
        return ({n.strip(): table.column(i).to_pylist() for i, n in enumerate(table.column_names)},
                list(range(2, table.num_rows + 2)))
    if uri.endswith(".jsonl"):
        records, lines = [], []
        for number, line in enumerate(data.decode("utf-8-sig").split("\n"), 1):
            if line.strip():
                records.append(json.loads(line))
                lines.append(number)
        names = list(dict.fromkeys(k for r in records for k in r))
        return {n: [r.get(n) for r in records] for n in names}, lines
    table = pq.read_table(pa.BufferReader(data))
    return ({n: table.column(i).to_pylist() for i, n in enumerate(table.column_names)},
            list(range(1, table.num_rows + 1)))


def _ref_text(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if not math.isfinite(value):
            return ""
        if value.is_integer():
            return str(int(value))
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace").strip()
    return str(value).strip()


def _ref_resolve(value: str, folder: str) -> str:
    if storage.is_s3(value):
        return value
    value = os.path.expanduser(value.removeprefix("file://"))
    if os.path.isabs(value):
        return os.path.normpath(value)
    if storage.is_s3(folder):
        return "s3://" + posixpath.normpath(posixpath.join(folder.removeprefix("s3://"), value))
    return os.path.normpath(storage.join(folder, value))


def _ref_safe(value):
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _ref_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_ref_safe(v) for v in value]
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return str(value)


def _ref_labels(values: list, datasets: list[str]) -> tuple[list[int], list[str]]:
    parts = [(str(v), v) if isinstance(v, int) and not isinstance(v, bool) else
             (t, int(t) if re.fullmatch(r"[+-]?\d+", t) else None) for v in values for t in [_ref_text(v)]]
    labels, names = [-1] * len(values), [""] * len(values)
    rows_of: dict[str, list[int]] = defaultdict(list)
    for i, ((text, _), name) in enumerate(zip(parts, datasets, strict=True)):
        if text:
            rows_of[name].append(i)
    for rows in rows_of.values():
        if all(parts[i][1] is not None for i in rows):
            for i in rows:
                labels[i] = parts[i][1]
            continue
        index = {text: k for k, text in enumerate(sorted({parts[i][0] for i in rows}))}
        for i in rows:
            labels[i], names[i] = index[parts[i][0]], parts[i][0]
    return labels, names


# ----------------------------------------------------------------------------- hostile tables

TEXT = ["", " ", "a", "a\"b", "a\\b", "\\\"", "é", "日本", "tab\there", "nl\nx", "\x00", "\x7f",
        "\x1f", "\U0001f600", "  pad  ", "\u2028", "\xa0nb\xa0", "\x1cfs", "007", "3", "-4", "+5", "3.0",
        "\u0663", "true", "null", "a,b"]
PATHS = ["p.jpg", "sub/p.jpg", "/abs/p.jpg", "./x/../y.jpg", "x/./y.jpg", "a//b.jpg", "dir/", "..", ".",
         "...", "~/p.jpg", "file:///tmp/p.jpg", "s3://b/k.jpg", " sub/q.jpg ", ".hidden/p.jpg", "/",
         "//two/p.jpg", ""]
FLOATS = [0.0, -0.0, 1.0, -7.0, 0.1, 1 / 3, 2.5, 1e-4, 9.99e-5, 1e-5, 1.5e-7, 5e-324, 123.456, 1e15, 1e16,
          9999999999999998.0, 12345678901234.5, 0.30000000000000004, 1.5e300, float("nan"), float("inf"),
          -float("inf")]
LABELS = ["", "1", "2", "cat", "dog", " 3 ", "٣", "+4", "-0"]


def _rows(rng: random.Random, n: int) -> list[dict]:
    def cell() -> str:
        return "".join(rng.choice(TEXT) for _ in range(rng.randint(1, 2)))

    ids = [rng.choice(["", " ", "é1", "dup", "a\"q", "dup "]) if rng.random() < 0.05 else f"id{i}"
           for i in range(n)]
    return [{"item_id": ids[i], "image_uri": rng.choice(PATHS + ["p.jpg"] * 10), "label": rng.choice(LABELS),
             "dataset": rng.choice(["", "d1", " d2 ", "x" * 3]), "zeta": cell(), "Alpha": cell(), "é": cell(),
             "a\"k": cell(), " spaced ": cell()} for i in range(n)]


def _typed(rng: random.Random):
    scaled = rng.uniform(-1, 1) * 10 ** rng.randint(-20, 20)
    return rng.choice([None, True, False, 0, -3, 2 ** 70, rng.choice(FLOATS), rng.choice(TEXT),
                       [1, "é", None], {"b": 1, "a": [2.5, None]}, scaled])


def _assert_same(uri: Path, dataset: str = "") -> None:
    rows, rejects, meta = reference_read(str(uri), dataset)
    table = read_item_table(str(uri), dataset)
    assert table.rows.schema == ROWS_SCHEMA
    got = table.rows.to_pylist()
    assert len(got) == len(rows)
    for column in ROWS_SCHEMA.names:  # a column at a time: a failure names it and the first rows differing
        differ = [(a[column], b[column]) for a, b in zip(got, rows, strict=True) if a[column] != b[column]]
        assert not differ, (column, differ[:3])
    assert table.rejects == rejects and table.metadata_columns == meta


@pytest.mark.parametrize("seed", [0, 1])
def test_csv_jsonl_and_parquet_tables_read_as_the_per_row_reader_read_them(tmp_path, seed):
    rng = random.Random(seed)
    rows = _rows(rng, 1500)
    with open(tmp_path / "shop.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    _assert_same(tmp_path / "shop.csv")
    _assert_same(tmp_path / "shop.csv", dataset="given")
    with open(tmp_path / "feed.jsonl", "w") as f:
        for r in rows[:500]:
            record = {**r, "zeta": _typed(rng), "label": rng.choice([None, 1, 2.0, "cat", True, " 5", 3.5]),
                      "item_id": rng.choice([r["item_id"]] * 6 + [7, 7.0, 1e20, True, None, float("nan")])}
            if rng.random() < 0.2:
                record.pop("Alpha")
            f.write(json.dumps(record) + ("\n\n" if rng.random() < 0.05 else "\n"))
    _assert_same(tmp_path / "feed.jsonl")


def test_parquet_tables_with_typed_columns_read_as_the_per_row_reader_read_them(tmp_path):
    rng = random.Random(2)
    n = 3000

    def pick(values: list, kind=None) -> pa.Array:
        return pa.array([rng.choice(values) for _ in range(n)], kind)

    table = pa.table({
        "item_id": pa.array([None if rng.random() < 0.03 else i % 2900 for i in range(n)], pa.int64()),
        "image_uri": pick(PATHS + ["p.jpg"] * 20), "label": pick([None, 1.0, 2.0, float("nan")]),
        "f64": pick(FLOATS + [None], pa.float64()), "f32": pick(FLOATS[:13] + [None], pa.float32()),
        "random": pa.array([rng.uniform(-1, 1) * 10 ** rng.randint(-25, 25) for _ in range(n)]),
        "i8": pick([None, -128, 5], pa.int8()), "u64": pick([None, 2 ** 64 - 1, 0], pa.uint64()),
        "flag": pick([None, True, False]), "text": pick(TEXT + [None]),
        "large": pick(TEXT + [None], pa.large_string()),
        "category": pick(["x", "y", None]).dictionary_encode(),
        "day": pick([None, datetime.date(2020, 1, 2)]),
        "at": pick([None, datetime.datetime(2020, 1, 2, 3, 4, 5)]),
        "price": pick([None, decimal.Decimal("1.50")], pa.decimal128(5, 2)),
        "blob": pick([None, b"\x00\x01"]),
        "tags": pick([None, [1, 2], []]), "nested": pick([None, {"y": 1.0, "x": "é"}]),
        "dataset": pick([None, "p", " q "])})
    pq.write_table(table, tmp_path / "typed.parquet", row_group_size=700)
    _assert_same(tmp_path / "typed.parquet")
    floats = table.set_column(0, "item_id", pick([None, 1.0, 2.5, float("nan"), 1e20, 3.0, -0.0]))
    floats = floats.set_column(2, "label", pick([None, True, False]))
    pq.write_table(floats, tmp_path / "floats.parquet")
    _assert_same(tmp_path / "floats.parquet")


def test_json_cells_are_json_dumps_of_every_float_and_string():
    """Arrow writes most cells; json.dumps the rest: the text must be json.dumps's in every case."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2 ** 63, 20000, dtype=np.int64).view(np.float64)  # doubles of every exponent
    scales = rng.integers(0, 8, 20000).tolist()
    prices = [round(x, k) for x, k in zip(rng.uniform(-1e6, 1e6, 20000).tolist(), scales, strict=True)]
    values = bits.tolist() + prices + FLOATS
    assert json_column(pa.array(values)).to_pylist() == [
        json.dumps(v if math.isfinite(v) else None) for v in values]
    texts = [t + u for t in TEXT for u in TEXT] + [None]
    assert json_column(pa.array(texts)).to_pylist() == [json.dumps(t) for t in texts]
