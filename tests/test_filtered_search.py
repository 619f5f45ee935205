"""Filtered search over an index (puma.index.filtered, ShardedIndex.filter_mask and search_ids): for
random filters of every operator, the hits are a brute-force scan of the matching rows (same ids, same
order) on Flat, and on IVF wherever the search visits every list (scanning the selected rows or with
FAISS); a broad
filter on IVF keeps its recall and every answer holds k hits whenever k items match, after removals and
a compaction."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pyarrow as pa
import pytest
from test_serve_partitions import LocalFanOut

from puma.config import IndexConfig
from puma.index import build_index, filtered
from puma.index.build import commit_changes, compact
from puma.index.filtered import FULL_SCAN_SHARE, NARROW_WIDEN, filter_table, filtered_nprobe, merged_types
from puma.index.filters import FilterError, evaluate, parse_filter
from puma.index.manifest import read_manifest
from puma.index.search import Holding, ShardedIndex
from puma.index.table import embedding_matrix
from puma.inference.search import run_search
from puma.serve.errors import RequestError
from puma.serve.live_index import LiveIndex
from puma.serve.partitions import Partition

DIM, N, SHARD = 16, 3000, 700
CATEGORIES = ("boots", "sandals", "sneakers", "heels", "slippers")
BRANDS = tuple(f"brand-{i}" for i in range(12))


def metadata(i: int, rng: np.random.Generator) -> str:
    row = {"category": CATEGORIES[i % 5], "brand": BRANDS[int(rng.integers(12))],
           "in_stock": bool(rng.random() < 0.7), "stock": int(rng.integers(0, 40))}
    if i % 9:
        row["price"] = round(float(rng.uniform(5, 200)), 2) if i % 2 else int(rng.integers(5, 200))
    if i % 4 == 0:
        row["tags"] = ["sale"]
    return json.dumps(row)


def table(start: int, n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, DIM)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    rows = range(start, start + n)
    return pa.table({"item_id": [f"sku-{i:05d}" for i in rows],
                     "embedding": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), DIM),
                     "dataset": ["shoes" if i % 3 else "bags" for i in rows],
                     "label": [i % 7 for i in rows],
                     "class_name": [f"class-{i % 7}" for i in rows],
                     "catalogue": ["s3://b/shop"] * n,
                     "metadata": [metadata(i, rng) for i in rows]})


def random_filter(rng: np.random.Generator, depth: int = 0) -> dict:
    """One random filter over the table's columns, using every operator."""
    pick = int(rng.integers(0, 12 if depth < 2 else 9))
    if pick == 0:
        return {"category": CATEGORIES[int(rng.integers(5))]}
    if pick == 1:
        chosen = rng.choice(12, int(rng.integers(1, 4)), replace=False)
        return {"brand": {"in": [BRANDS[int(i)] for i in chosen]}}
    if pick == 2:
        low = float(rng.uniform(5, 150))
        return {"price": {"gte": round(low, 1), "lt": round(low + float(rng.uniform(1, 60)), 1)}}
    if pick == 3:
        return {"in_stock": bool(rng.random() < 0.5)}
    if pick == 4:
        return {"stock": {rng.choice(["gt", "lte", "ne", "eq"]): int(rng.integers(0, 40))}}
    if pick == 5:
        return {"price": {"exists": bool(rng.random() < 0.5)}}
    if pick == 6:
        return {"label": {"in": [int(rng.integers(7)), int(rng.integers(7))]}, "dataset": "shoes"}
    if pick == 7:
        return {"tags": {"exists": True}, "class_name": {"ne": "class-3"}}
    if pick == 8:
        return {"brand": BRANDS[int(rng.integers(12))], "stock": {"lt": 5}}  # very selective
    if pick == 9:
        return {"and": [random_filter(rng, depth + 1), random_filter(rng, depth + 1)]}
    if pick == 10:
        return {"or": [random_filter(rng, depth + 1), random_filter(rng, depth + 1)]}
    return {"not": random_filter(rng, depth + 1)}


def matches(where: dict, row: dict) -> bool:
    """The filter language in plain Python over one row (missing values match no comparison)."""
    if "and" in where:
        return all(matches(f, row) for f in where["and"])
    if "or" in where:
        return any(matches(f, row) for f in where["or"])
    if "not" in where:
        return not matches(where["not"], row)
    for column, test in where.items():
        value = row.get(column)
        ops = test if isinstance(test, dict) else {"eq": test}
        for op, want in ops.items():
            if op == "exists":
                ok = (value is not None) == want
            elif value is None:
                ok = False
            elif op == "in":
                ok = value in want
            else:
                ok = {"eq": value == want, "ne": value != want, "gt": value > want if op == "gt" else 0,
                      "gte": value >= want if op == "gte" else 0, "lt": value < want if op == "lt" else 0,
                      "lte": value <= want if op == "lte" else 0}[op]
            if not ok:
                return False
    return True


def rows_of(index: ShardedIndex) -> list[dict]:
    stored = index.table(["item_id", "dataset", "label", "class_name", "catalogue", "metadata"])
    return [{**json.loads(r.pop("metadata") or "{}"), **r} for r in stored.to_pylist()]


def all_vectors(index: ShardedIndex) -> np.ndarray:
    """Every row's stored embedding (N, E), removed rows too."""
    return embedding_matrix(index.table(["item_id", "embedding"]))


def brute_force(vectors: np.ndarray, allowed: np.ndarray, q: np.ndarray, k: int) -> list[int]:
    """The rows of the k best allowed items by inner product (ties: lower row first)."""
    rows = np.flatnonzero(allowed)
    scores = vectors[rows] @ q
    return rows[np.lexsort((rows, -scores))[:k]].tolist()


def built(tmp_path, index_type: str) -> ShardedIndex:
    uri = str(tmp_path / index_type)
    cfg = IndexConfig(index_type=index_type, shard_size=SHARD, nlist=32 if index_type != "flat" else 0,
                      metric="ip", train_sample=N)
    build_index(uri, table(0, N, 0), cfg, model_id="m")
    commit_changes(uri, table(N, 300, 1), np.arange(0, N, 5))  # a fifth removed, 300 added
    compact(uri, 0.1)  # the shards rewritten without their removed rows (rows move, ids leave gaps)
    commit_changes(uri, remove=np.arange(1, 700, 7))  # and removals after the compaction
    return ShardedIndex.open(uri, nprobe=4, use_gpu=False, holding=Holding(filters=True))


BRUTE_FORCE_ROWS = 150  # the tests' threshold (puma.index.filtered.BRUTE_FORCE_VALUES / DIM): on this
# small index the three ways of a filtered search all occur: an exact scan of at most 150 selected rows'
# vectors, IVF over every list, IVF over nprobe / fraction lists


@pytest.fixture
def few_rows_brute_force(monkeypatch):
    monkeypatch.setattr(filtered, "BRUTE_FORCE_VALUES", BRUTE_FORCE_ROWS * DIM)


@pytest.mark.parametrize("index_type", ["flat", "ivf_flat"])
def test_filtered_hits_are_a_brute_force_scan_of_the_matching_rows(tmp_path, index_type,
                                                                   few_rows_brute_force):
    index = built(tmp_path, index_type)
    rows, rng, vectors = rows_of(index), np.random.default_rng(7), all_vectors(index)
    exact, filtered_recall, plain_recall, ways = 0, [], [], set()
    for i in range(200):
        where = random_filter(rng)
        want_mask = np.array([matches(where, r) and live for r, live in zip(rows, index.live, strict=True)])
        mask = index.filter_mask(parse_filter(where))
        assert np.array_equal(mask, want_mask), where
        q = rng.standard_normal(DIM).astype(np.float32)
        k = int(rng.integers(1, 30))
        _, got = index.search_ids(q[None, :], k, allowed=index.select(mask))
        got = [r for r in got[0].tolist() if r >= 0]
        want = brute_force(vectors, mask, q, k)
        assert len(got) == min(k, int(mask.sum())), where  # k hits whenever k items match
        scans_all = filtered_nprobe(4, 32, int(mask.sum()), index.live_total) == 32
        scanned = mask.sum() <= BRUTE_FORCE_ROWS
        ways.add("scan" if scanned else "every list" if scans_all else "some lists")
        assert scans_all or not scanned  # this index's scans: of every list (few rows, many lists each)
        if index_type == "flat" or scans_all:
            assert got == want, (i, where)
            exact += 1
        else:  # a broad filter on IVF: approximate like an unfiltered search of the same nprobe
            filtered_recall.append(len(set(got) & set(want)) / len(want))
            _, plain = index.search_ids(q[None, :], k)
            everything = brute_force(vectors, index.live, q, k)
            plain_recall.append(len(set(plain[0].tolist()) & set(everything)) / len(everything))
    assert exact >= 60, (exact, len(filtered_recall))  # 77 of 200 scan every list (FULL_SCAN_SHARE 0.8)
    assert ways == {"scan", "every list", "some lists"}, ways
    if filtered_recall:  # the lists visited grow as the filter narrows: recall does not fall with it
        assert np.mean(filtered_recall) >= np.mean(plain_recall) - 0.05, (filtered_recall, plain_recall)


def test_filter_errors_name_the_column_and_what_is_valid(tmp_path):
    index = built(tmp_path, "flat")
    assert index.filter_types["price"] == "number" and index.filter_types["in_stock"] == "boolean"
    assert index.filter_types["tags"] == "json" and index.filter_types["category"] == "string"
    with pytest.raises(FilterError, match=r"colour.*brand.*category"):
        index.filter_mask(parse_filter({"colour": "red"}))
    with pytest.raises(FilterError, match=r"price.*number"):
        index.filter_mask(parse_filter({"price": "cheap"}))
    with pytest.raises(FilterError, match=r"category.*string"):
        index.filter_mask(parse_filter({"category": {"lt": 3}}))
    described = index.describe_filters()
    assert described["category"] == {"type": "string", "values": sorted(CATEGORIES)}
    assert described["price"] == {"type": "number"}


def test_the_lists_visited_grow_as_the_filter_narrows_then_cover_every_list():
    assert filtered_nprobe(16, 4096, 1000, 1000) == 16
    assert filtered_nprobe(16, 4096, 500, 1000) == 32
    assert filtered_nprobe(16, 4096, 400, 1000) == 40  # POST_FILTER_SHARE: nprobe / f
    assert filtered_nprobe(16, 4096, 399, 1000) == math.ceil(16 * NARROW_WIDEN * 1000 / 399)  # below it
    assert filtered_nprobe(16, 4096, 50, 1000) == math.ceil(320 * NARROW_WIDEN)
    full = int(np.ceil(16 * NARROW_WIDEN / (FULL_SCAN_SHARE * 4096) * 1000)) - 1
    assert filtered_nprobe(16, 4096, full, 1000) == 4096
    assert filtered_nprobe(16, 4096, 0, 1000) == 4096


@pytest.mark.parametrize("index_type", ["flat", "ivf_flat"])
def test_the_service_filters_like_the_index_in_one_and_three_partitions(tmp_path, index_type,
                                                                       few_rows_brute_force):
    """LiveIndex (the service's index) and a 3-partition fan-out give exactly the brute-force hits of
    random filters wherever the search is exact, and the same hits as each other everywhere."""
    built(tmp_path, index_type)
    uri = str(tmp_path / index_type)
    cfg = IndexConfig(uri=uri, use_gpu=False, nprobe=4, cache_dir=str(tmp_path / "cache"))
    one = LiveIndex(cfg, "m", DIM)
    fan = LocalFanOut([LiveIndex(cfg, "m", DIM, partition=Partition(p, 3)) for p in range(3)])
    index = one.state.index
    vectors, rows, rng = all_vectors(index), rows_of(index), np.random.default_rng(11)
    for i in range(200):
        where = parse_filter(random_filter(rng))
        q = rng.standard_normal(DIM).astype(np.float32)
        k = int(rng.integers(1, 20))
        want_mask = np.array([matches(where.to_json(), r) and live
                              for r, live in zip(rows, index.live, strict=True)])
        got = one.search_vector(q, k, where=where)
        parts = asyncio.run(fan.search_vector(q, k, (), (), where, ""))
        assert len(got) == len(parts) == min(k, int(want_mask.sum()))
        want = index.to_item_ids(np.array(brute_force(vectors, want_mask, q, k), dtype=np.int64)).tolist()
        # exact: Flat, or a filter narrow enough that every partition scans all its lists (each
        # partition decides from its own share of the matches: a margin below FULL_SCAN_SHARE's bound)
        if index_type == "flat" or want_mask.sum() <= 0.7 * 4 * index.live_total / (FULL_SCAN_SHARE * 32) \
                or want_mask.sum() <= BRUTE_FORCE_ROWS:  # (a partition's share is no larger)
            assert [h["item_id"] for h in got] == want, (i, where.key)
            assert same_hits(parts, got), (i, where.key)
    item = rows[int(np.flatnonzero(index.live)[3])]["item_id"]
    boots = parse_filter({"category": "boots"})
    hits = one.search_item(item, 5, where=boots)
    assert hits == asyncio.run(fan.search_item(item, 5, (), (), False, boots, ""))
    assert {h["metadata"]["category"] for h in hits} == {"boots"}
    for bad, named in [({"colour": "red"}, "colour"), ({"price": "cheap"}, "price"),
                       ({"in_stock": {"gt": 1}}, "in_stock")]:
        with pytest.raises(RequestError, match=named) as one_error:
            one.search_vector(vectors[0], 3, where=parse_filter(bad))
        with pytest.raises(RequestError, match=named) as fan_error:
            asyncio.run(fan.search_vector(vectors[0], 3, (), (), parse_filter(bad), ""))
        assert one_error.value.status == fan_error.value.status == 422
    stats = asyncio.run(fan.stats_async())
    assert stats["filterable"] == one.stats()["filterable"]
    assert stats["filterable"]["category"]["values"] == sorted(CATEGORIES)


def same_hits(a: list[dict], b: list[dict]) -> bool:
    """The same hits, scores equal to float32 precision: a partition may scan its few selected rows
    exactly (scores summed in float64) where the whole index asks FAISS (summed in float32)."""
    def without_score(hits: list[dict]) -> list[dict]:
        return [{n: v for n, v in h.items() if n != "score"} for h in hits]

    return without_score(a) == without_score(b) and \
        np.allclose([h["score"] for h in a], [h["score"] for h in b], rtol=0, atol=2e-6)


@pytest.mark.parametrize("index_type", ["flat", "ivf_flat"])
def test_jobs_search_filters_like_the_index(tmp_path, index_type, few_rows_brute_force):
    """jobs/search.py's run_search with 100 random filters per index type (200 in all, every operator):
    each query's results are the brute-force top-k of the matching rows (fewer when fewer match) wherever
    the search is exact (Flat; on IVF a scan of the selected rows or of every list), else the index's own
    filtered search; item queries leave the item out."""
    index = built(tmp_path, index_type)
    vectors, rows = all_vectors(index), rows_of(index)
    rng = np.random.default_rng(5 if index_type == "flat" else 6)
    q = rng.standard_normal((3, DIM)).astype(np.float32)
    np.save(tmp_path / "q.npy", q)
    cfg = IndexConfig(uri=str(tmp_path / index_type), use_gpu=False, nprobe=4)
    exact = 0
    for n in range(100):
        raw = random_filter(rng)
        keep = index.filter_mask(parse_filter(raw))  # the rows it matches (checked against Python above)
        k = int(rng.integers(1, 20))
        out = run_search(cfg, k, str(tmp_path / "q.npy"), out_uri=str(tmp_path / "r.parquet"),
                         where=parse_filter(raw))
        is_exact = index_type == "flat" or keep.sum() <= BRUTE_FORCE_ROWS \
            or filtered_nprobe(4, 32, int(keep.sum()), index.live_total) == 32
        exact += is_exact
        _, same = index.search_ids(q, k, allowed=index.select(keep))
        for i in range(len(q)):
            got = [r["item_id"] for r in out.results.to_pylist() if r["query"] == f"q{i}"]
            want = brute_force(vectors, keep, q[i], k) if is_exact else [r for r in same[i] if r >= 0]
            assert got == index.to_item_ids(np.array(want, dtype=np.int64)).tolist(), (n, raw, i)
            assert len(got) == min(k, int(keep.sum())), (n, raw)
    assert exact >= 40, exact
    item = rows[int(np.flatnonzero(index.live)[0])]["item_id"]
    out = run_search(cfg, 5, item_ids=[item], out_uri=str(tmp_path / "i.parquet"),
                     where=parse_filter({"category": "heels"}))
    assert len(out.results) == 5 and item not in out.results["item_id"].to_pylist()
    assert set(json.loads(m)["category"] for m in out.results["metadata"].to_pylist()) == {"heels"}


def test_a_csv_tables_text_cells_filter_as_numbers_and_booleans():
    """A CSV table's metadata is stored as text: plain numbers filter as numbers, true/false as
    booleans, and text with a leading zero (a zip code) stays text."""
    rows = [{"price": "10", "weight": "2.5", "in_stock": "true", "zip": "02134", "size": "42"},
            {"price": "7", "weight": "1e3", "in_stock": "false", "zip": "10001", "size": "XL"},
            {"price": "-3", "in_stock": "true", "zip": "94103"}, {}]
    table = filter_table(pa.table({"metadata": [json.dumps(r) for r in rows]}))
    types = merged_types([table])
    assert {c: types[c] for c in ("price", "weight", "in_stock", "zip", "size")} == \
        {"price": "number", "weight": "number", "in_stock": "boolean", "zip": "string", "size": "string"}
    assert table["price"].type == pa.int64() and table["weight"].type == pa.float64()
    cheap = parse_filter({"price": {"lt": 8}, "in_stock": True})
    assert evaluate(cheap, table).tolist() == [False, False, True, False]
    assert evaluate(parse_filter({"weight": {"gte": 2.5}}), table).tolist() == [True, True, False, False]
    assert evaluate(parse_filter({"zip": "02134"}), table).tolist() == [True, False, False, False]


def test_the_exact_scan_ranks_like_faiss_pads_and_keeps_equal_scores_in_row_order():
    import faiss

    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 8)).astype(np.float32)
    rows = np.arange(100, 140)
    q = rng.standard_normal((3, 8)).astype(np.float32)
    for metric, flat in (("ip", faiss.IndexFlatIP(8)), ("l2", faiss.IndexFlatL2(8))):
        flat.add(x)
        want_scores, want = flat.search(q, 10)
        scores, got = filtered.exact_topk(x, rows, q, 10, metric)
        assert np.array_equal(got, rows[want]), metric
        np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-4)
    x[7] = x[3]  # an equal score: the lower row first
    _, equal = filtered.exact_topk(x, rows, x[3:4] * 2, 40, "ip")
    assert equal[0, :2].tolist() == [103, 107]
    scores, padded = filtered.exact_topk(x[:3], rows[:3], q, 5, "l2")
    assert (padded[:, 3:] == -1).all() and np.isinf(scores[:, 3:]).all() and (padded[:, :3] >= 100).all()


def test_selected_vectors_are_the_stored_embeddings_wherever_the_index_holds_them(tmp_path):
    from puma.index.cache import LocalCache

    index = built(tmp_path, "ivf_flat")
    vectors = all_vectors(index)
    rows = np.flatnonzero(index.live)[::37]
    uri = str(tmp_path / "ivf_flat")
    in_file = ShardedIndex.open(uri, use_gpu=False, holding=Holding(
        file_columns=("item_id", "embedding"), cache=LocalCache(str(tmp_path / "cache"))))
    in_memory = ShardedIndex.open(uri, use_gpu=False, holding=Holding(columns=("item_id", "embedding")))
    for held in (index, in_file, in_memory):  # the shards' Parquet, the mapped column file, memory
        assert np.array_equal(held.vectors_at(rows), vectors[rows])


def test_a_repeated_filter_scans_its_gathered_vectors_held_within_the_budget(tmp_path, few_rows_brute_force):
    """A selection scanned exactly keeps its rows' embeddings (gathered once, at its second use: a filter
    used once gathers only what its scan ranks) while the state's selections hold at most
    index.filter_cache_mb of them; a repeated filter's hits are those of a replica that keeps none
    (index.filter_cache_mb=0), the first time and again."""
    index, rng = built(tmp_path, "ivf_flat"), np.random.default_rng(5)
    scanned = {}  # two filters that select few enough rows to scan exactly -> their rows
    while len(scanned) < 2:
        where = parse_filter(random_filter(rng))
        rows = int(index.filter_mask(where, unknown_ok=True).sum())
        if 0 < rows <= BRUTE_FORCE_ROWS:
            scanned[where] = rows
    budget = next(iter(scanned.values())) * DIM * 4  # bytes: the first filter's vectors, not the second's
    uri = str(tmp_path / "ivf_flat")
    holding = LiveIndex(IndexConfig(uri=uri, use_gpu=False, nprobe=4, filter_cache_mb=budget / 1e6,
                                    cache_dir=str(tmp_path / "a")), "m", DIM)
    keeping_none = LiveIndex(IndexConfig(uri=uri, use_gpu=False, nprobe=4, filter_cache_mb=0,
                                         cache_dir=str(tmp_path / "b")), "m", DIM)
    for use in range(2):
        for where in scanned:
            q = rng.standard_normal(DIM).astype(np.float32)
            assert holding.search_vector(q, 7, where=where) == keeping_none.search_vector(q, 7, where=where)
        if use == 0:  # used once: nothing held yet
            assert holding.state.selection_bytes == 0
            assert all(s[0].vectors is None for s in holding.state.selections.values())
    first, second = (s[0] for s in holding.state.selections.values())
    index = holding.state.index
    assert np.array_equal(first.vectors, index.vectors_at(first.rows))  # the stored embeddings
    assert second.vectors is None and second.rows is not None  # past the budget: gathered at each scan
    assert holding.state.selection_bytes == first.vectors.nbytes == budget
    assert all(s[0].vectors is None for s in keeping_none.state.selections.values())


BROAD = ({"dataset": "shoes"}, {"in_stock": True}, {"category": {"ne": "boots"}},
         {"or": [{"category": "boots"}, {"stock": {"gte": 20}}]}, {"not": {"brand": "brand-3"}})


@pytest.mark.parametrize("index_type", ["flat", "ivf_flat"])
def test_a_broad_filter_filters_the_hits_of_an_unfiltered_search_as_the_selection_would(tmp_path, index_type):
    """A filter keeping at least POST_FILTER_SHARE of the items is evaluated on the hits of an unfiltered
    search over the lists the search with the selection would visit: where k of them pass, they equal
    that search's hits (on Flat: the brute-force scan of the matching rows); a narrow filter is left to
    the selection."""
    index, rng = built(tmp_path, index_type), np.random.default_rng(11)
    vectors, answered = all_vectors(index), 0
    for i in range(100):
        where = parse_filter(BROAD[i % len(BROAD)])
        mask = index.filter_mask(where)
        assert index.filter_share(where) == pytest.approx(mask.sum() / index.live_total)  # every live row
        assert mask.sum() >= filtered.POST_FILTER_SHARE * index.live_total, where
        q, k = rng.standard_normal(DIM).astype(np.float32), int(rng.integers(1, 30))
        found = index.search_post_filtered(q[None, :], k, where)
        if found is None:
            continue
        answered += 1
        _, selected = index.search_ids(q[None, :], k, allowed=index.select(mask))
        assert found[1][0].tolist() == selected[0].tolist(), (i, where)
        if index_type == "flat":
            assert found[1][0].tolist() == brute_force(vectors, mask, q, k), (i, where)
    assert answered >= 90, answered
    narrow = parse_filter({"brand": "brand-1", "in_stock": False})
    assert index.search_post_filtered(rng.standard_normal((1, DIM)).astype(np.float32), 5, narrow) is None


def test_the_service_falls_back_to_the_selection_when_too_few_hits_pass(tmp_path, monkeypatch):
    """With no margin (hits = k / share), about half the searches leave fewer than k passing hits: those
    are answered with the selection, so every answer is still the brute-force top k of the matching rows."""
    monkeypatch.setattr(filtered, "POST_FILTER_MARGIN", 1.0)
    index, rng = built(tmp_path, "flat"), np.random.default_rng(3)
    live = LiveIndex(IndexConfig(uri=str(tmp_path / "flat"), use_gpu=False, cache_dir=str(tmp_path / "c")),
                     "m", DIM)
    vectors, item_ids, post_filtered = all_vectors(index), index.to_item_ids(np.arange(index.ntotal)), 0
    for i in range(60):
        where = parse_filter(BROAD[i % len(BROAD)])
        q = rng.standard_normal(DIM).astype(np.float32)
        post_filtered += live.state.index.search_post_filtered(q[None, :], 12, where) is not None
        hits = [h["item_id"] for h in live.search_vector(q, 12, where=where)]
        assert hits == item_ids[brute_force(vectors, index.filter_mask(where), q, 12)].tolist(), (i, where)
    assert 5 <= post_filtered <= 55, post_filtered


def test_the_exact_scan_on_ivf_ranks_the_selected_rows_in_the_lists_the_search_would_visit(tmp_path,
                                                                                           monkeypatch):
    """Every selection scanned (BRUTE_FORCE_VALUES raised): on IVF the scan ranks the selected rows of
    the nprobe / fraction lists nearest the query (after removals and a compaction: ids with gaps), so
    its hits are FAISS's with the selection over the same lists, and k whenever k items match."""
    index = built(tmp_path, "ivf_flat")
    some_lists = scan_like_faiss(index, np.random.default_rng(13), monkeypatch, 150)
    assert some_lists >= 30, some_lists  # the scan of the nearest lists, not only of every list


def test_a_refresh_keeps_the_unchanged_shards_row_lists_and_the_scan_stays_faiss_s(tmp_path, monkeypatch):
    """Each row's IVF list is kept per loaded shard: after items are added and removed, the refreshed
    index reuses the unchanged shards with their row lists (the same arrays, not rebuilt), gives the new
    and reloaded shards theirs, and its scans still equal FAISS with the selection."""
    index = built(tmp_path, "ivf_flat")
    scan_like_faiss(index, np.random.default_rng(17), monkeypatch, 20)  # the row lists made
    before = {s.entry.name: s._row_lists for s in index._loaded}
    uri = str(tmp_path / "ivf_flat")
    commit_changes(uri, table(N + 300, 400, 2), np.arange(N, N + 300, 3))  # a shard's removals change
    fresh = index.refreshed(read_manifest(uri))
    kept = [s for s in fresh._loaded if s in index._loaded]
    assert kept and len(kept) < len(fresh._loaded), (len(kept), len(fresh._loaded))
    some_lists = scan_like_faiss(fresh, np.random.default_rng(19), monkeypatch, 60)
    assert all(s._row_lists is before[s.entry.name] for s in kept)  # reused, not made again
    assert all(s._row_lists is not None for s in fresh._loaded)
    assert some_lists >= 10, some_lists


def scan_like_faiss(index: ShardedIndex, rng: np.random.Generator, monkeypatch, n: int) -> int:
    """For n random filters that select something, the scan's hits equal FAISS's with the selection
    (k whenever k items match); returns how many visited fewer than every list."""
    cases = []
    while len(cases) < n:
        mask = index.filter_mask(parse_filter(random_filter(rng)))
        if mask.any():  # an empty selection is an empty scan either way
            cases.append((mask, rng.standard_normal(DIM).astype(np.float32), int(rng.integers(1, 30))))
    with monkeypatch.context() as patch:
        patch.setattr(filtered, "BRUTE_FORCE_VALUES", 10**9)
        scanned = [(index.select(mask), q, k) for mask, q, k in cases]
        patch.setattr(filtered, "BRUTE_FORCE_VALUES", 0)
        with_faiss = [index.select(mask) for mask, _, _ in cases]
    some_lists = 0
    for (chosen, q, k), bitmap, (mask, _, _) in zip(scanned, with_faiss, cases, strict=True):
        assert chosen.rows is not None and bitmap.rows is None
        _, got = index.search_ids(q[None, :], k, allowed=chosen)
        _, want = index.search_ids(q[None, :], k, allowed=bitmap)
        assert got[0].tolist() == want[0].tolist(), int(mask.sum())
        assert (got[0] >= 0).sum() == min(k, int(mask.sum()))
        nlist = index.manifest.nlist
        some_lists += filtered_nprobe(4, nlist, int(mask.sum()), index.live_total) < nlist
    return some_lists


def range_filter(rng: np.random.Generator) -> dict:
    """A random filter that requires a number range: on the float column price (missing on some rows),
    the integer columns stock and label (float and out-of-range bounds too), alone or in an ``and``."""
    low = float(rng.uniform(-5, 200))
    pick = int(rng.integers(0, 8))
    if pick == 0:
        return {"price": {"gte": round(low, 1), "lt": round(low + float(rng.uniform(0, 30)), 1)}}
    if pick == 1:
        return {"stock": {"gt": round(float(rng.uniform(-1, 40)), 1), "lte": int(rng.integers(0, 40))}}
    if pick == 2:
        return {"stock": {"eq": [int(rng.integers(0, 40)), 2.5, 1e30][int(rng.integers(3))]}}
    if pick == 3:
        return {"label": {"lt": int(rng.integers(0, 3))}, "category": CATEGORIES[int(rng.integers(5))]}
    if pick == 4:
        return {"and": [{"and": [{"stock": {"gte": int(rng.integers(0, 40))}}, {"stock": {"lt": 1e30}}]},
                        {"price": {"lte": round(low, 2)}}, {"in_stock": True}]}
    if pick == 5:
        return {"and": [random_filter(rng, 2), {"price": {"gt": round(low, 1), "lt": round(low + 9, 1)}}]}
    if pick == 6:
        return {"price": {"gt": -1e308}}  # every priced row: too broad for the sorted columns
    return {"stock": {"lte": -float(rng.integers(0, 3))}, "brand": {"in": list(BRANDS[:4])}}


def range_json(b) -> dict:
    """A ranges.Bounds as the filter's JSON."""
    ends = {("gt" if b.low_open else "gte"): b.low, ("lt" if b.high_open else "lte"): b.high}
    return {op: v for op, v in ends.items() if v is not None}


def test_a_narrow_number_range_finds_its_rows_from_the_sorted_columns_as_the_mask_does(tmp_path):
    """IndexRows.range_match: for random filters requiring a number range, after removals, a compaction
    and a shard whose rows lack the column, the rows equal the filter's mask wherever the range is
    narrow enough to answer (and it answers those); or/not require no range and are left to the mask.
    Its count, for a filter that is only a range, equals the mask's count at any share."""
    from puma.index.ranges import RANGE_SHARE, required_ranges

    index = built(tmp_path, "flat")
    uri = str(tmp_path / "flat")
    lacking = table(N + 300, 200, 5)  # a shard without the stock column
    plain = [json.dumps({k: v for k, v in json.loads(m).items() if k != "stock"})
             for m in lacking.column("metadata").to_pylist()]
    gone = index.global_ids(np.flatnonzero(index.live)[::11])  # and tombstones in every old shard
    commit_changes(uri, lacking.set_column(6, "metadata", pa.array(plain)), gone)
    index = index.refreshed(read_manifest(uri))
    assert "stock" not in index._loaded[-1].filters.column_names
    assert all(not s.live.all() for s in index._loaded[:-1]), "removed rows stay as rows, not live"
    rng, answered, refused, counted_broad = np.random.default_rng(23), 0, 0, 0
    for _ in range(300):
        where = parse_filter(range_filter(rng))
        (rows, count), mask = index.range_match(where), index.filter_mask(where)
        assert count is None or count == mask.sum(), where.key  # counted without evaluating it
        if rows is None:  # refused: every range it requires holds more than RANGE_SHARE of the rows
            refused += 1
            counted_broad += count is not None
            narrowest = min(index.filter_mask(parse_filter({column: range_json(b)})).sum()
                            for column, b in required_ranges(where).items())
            assert narrowest > 0.8 * RANGE_SHARE * index.live_total, where.key
            continue
        answered += 1
        assert np.array_equal(rows, np.flatnonzero(mask)), where.key
    assert answered >= 200 and refused >= 20 and counted_broad >= 10, (answered, refused, counted_broad)
    assert "stock" in index._loaded[0].sorted_columns  # made once, kept with the loaded shard
    for unranged in ({"or": [{"stock": {"lt": 3}}, {"stock": {"gt": 38}}]}, {"not": {"stock": {"gte": 1}}},
                     {"category": "boots"}):
        assert index.range_match(parse_filter(unranged)) == (None, None)


def test_the_scores_read_in_place_equal_numpy_on_every_holding_and_open_no_thread_team(tmp_path, monkeypatch):
    """IndexRows.scores_at (FAISS reading the mapped or held float32 matrix in place) equals numpy on
    the gathered vectors, for ip and l2; it scores on the calling thread (FAISS's by-id functions would
    open an OpenMP team, whose barrier stalls on a busy machine); and the scan over an index holding
    its embeddings in a column file still equals FAISS with the selection."""
    import os
    import threading

    from puma.index import backend
    from puma.index.cache import LocalCache

    uri, vectors = str(tmp_path / "ivf_flat"), all_vectors(built(tmp_path, "ivf_flat"))
    in_file = ShardedIndex.open(uri, nprobe=4, use_gpu=False, holding=Holding(
        file_columns=("item_id", "embedding"), filters=True, cache=LocalCache(str(tmp_path / "cache"))))
    in_memory = ShardedIndex.open(uri, use_gpu=False, holding=Holding(columns=("item_id", "embedding")))
    parquet = ShardedIndex.open(uri, use_gpu=False)
    rng = np.random.default_rng(29)
    rows = np.flatnonzero(in_file.live)[np.sort(rng.choice(in_file.live_total, 1203, replace=False))]
    q = rng.standard_normal(DIM).astype(np.float32)
    want = {"ip": vectors[rows] @ q, "l2": ((vectors[rows] - q) ** 2).sum(axis=1)}
    for held in (in_file, in_memory, parquet):
        for metric in ("ip", "l2"):
            np.testing.assert_allclose(held.scores_at(q, rows, metric), want[metric], rtol=1e-5, atol=1e-5)
    with pytest.raises(IndexError):
        backend.scores_of_rows(vectors, q, np.array([0, len(vectors)]), "ip")

    started = {}

    def scan_on_a_new_thread() -> None:  # a thread's first OpenMP team leaves its workers running
        before = len(os.listdir("/proc/self/task"))
        in_file.scores_at(q, rows, "ip")
        started["threads"] = len(os.listdir("/proc/self/task")) - before

    thread = threading.Thread(target=scan_on_a_new_thread)
    thread.start()
    thread.join()
    assert started == {"threads": 0}
    assert scan_like_faiss(in_file, np.random.default_rng(31), monkeypatch, 30) >= 5


def test_the_nearest_lists_are_those_the_quantizers_search_returns():
    """backend.nearest_lists (FAISS's list scores, np.argpartition) picks the same lists as the flat
    quantizer's search, for inner product and L2, up to every list."""
    import faiss

    from puma.index import backend

    rng = np.random.default_rng(37)
    centroids = rng.standard_normal((512, DIM)).astype(np.float32)
    for quantizer in (faiss.IndexFlatIP(DIM), faiss.IndexFlatL2(DIM)):
        quantizer.add(centroids)
        for q in rng.standard_normal((40, DIM)).astype(np.float32):
            for count in (1, 37, 300, 511, 512, 600):
                want = set(quantizer.search(q[None, :], min(count, 512))[1][0].tolist())
                assert set(backend.nearest_lists(quantizer, q, count).tolist()) == want, count
