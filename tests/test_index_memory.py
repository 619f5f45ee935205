"""The served index at millions of items, on small real indexes: item ids found by hash (after removals,
re-adds and compaction, through hash collisions), hit fields read from local column files, FAISS
on-disk inverted lists giving exactly the in-memory results, the local cache cleaned up, index.on_disk
decided by the plan, and the service's plan made in a child process that takes torch with it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa
import pytest

from puma.config import IndexConfig, load_config
from puma.index import ShardedIndex, build_index, read_manifest
from puma.index import lookup as index_lookup
from puma.index import rows as index_rows
from puma.index import search as index_search
from puma.index.build import commit_changes, compact
from puma.index.cache import PREFIX, LocalCache
from puma.index.lookup import hash_id, hash_ids
from puma.index.search import Holding
from puma.serve import run
from puma.serve.errors import ServiceSetupError
from puma.serve.live_index import HIT_COLUMNS, LiveIndex
from puma.serve.plan import plan_service

REPO = Path(__file__).resolve().parent.parent
DIM = 8


def vectors(n: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def items(names: list[str], seed: int, full: bool = True) -> pa.Table:
    """The embed job's columns (``full``), or only item_id, embedding and dataset (an older shard)."""
    x = vectors(len(names), seed)
    n = len(names)
    table = {"item_id": names, "embedding": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), DIM),
             "dataset": [("shoes", "bags", "hats")[i % 3] for i in range(n)]}
    if full:
        table |= {"label": list(range(n)), "class_name": [f"class {i % 4}" for i in range(n)],
                  "catalogue": ["s3://b/shop.csv"] * n, "image_uri": [f"s3://b/img/{m}.jpg" for m in names],
                  "image_row": [-1] * n,
                  "metadata": [None if i % 5 == 0 else f'{{"price": {i}.5}}' for i in range(n)]}
    return pa.table(table)


def grown_index(root: Path, kind: str = "ivf_flat") -> str:
    """Five shards (a: 3 x 100, b: 50 without the catalogue columns, c: 40); removals in four."""
    uri = str(root / "index")
    cfg = IndexConfig(index_type=kind, nlist=8, pq_m=4, shard_size=100, use_gpu=False)
    build_index(uri, items([f"a/{i:03d}" for i in range(300)], 1), cfg)
    commit_changes(uri, items([f"b/{i:03d}" for i in range(50)], 2, full=False))
    commit_changes(uri, items([f"c/{i:03d}" for i in range(40)], 3))
    commit_changes(uri, remove=np.array([0, 5, 101, 102, 299, 310]))
    return uri


ASKED = [f"{p}/{i:03d}" for p in "abcd" for i in range(305)]  # every id, and some never indexed


def scan(index: ShardedIndex) -> dict[str, int]:
    """Every live item id -> its row, by reading the stored ids (the brute-force answer)."""
    stored = index.table(["item_id"])["item_id"].to_pylist()
    return {item: row for row, item in enumerate(stored) if index.live[row]}


def served(uri: str, cache: LocalCache, on_disk: bool = False) -> ShardedIndex:
    holding = Holding(("dataset",), ("item_id", "label", "metadata", "embedding"), cache=cache,
                      lists_on_disk=on_disk)
    return ShardedIndex.open(uri, use_gpu=False, nprobe=4, holding=holding)


def test_hash_ids_equal_the_python_hash_of_every_string():
    words = ["", "a", "sku-00001234", "héllo wörld ✓", "x" * 300, "cub/004.png"]
    for array in (pa.array(words), pa.array(words, pa.large_string()), pa.array(["pad", *words]).slice(1)):
        assert hash_ids(array).tolist() == [hash_id(w) for w in words]
    assert len(set(hash_ids(pa.array([f"sku-{i:08d}" for i in range(100_000)])).tolist())) == 100_000


def test_item_ids_are_found_like_a_scan_after_removals_readds_and_compaction(tmp_path):
    uri = grown_index(tmp_path)
    cache = LocalCache(str(tmp_path / "cache"))
    asked = ASKED
    old = served(uri, cache)

    def check(index: ShardedIndex) -> None:
        truth = scan(index)
        assert [index.find(item) for item in asked] == [truth.get(item, -1) for item in asked]
        known = [item for item in asked if item in truth]
        assert index.lookup(known).tolist() == [truth[item] for item in known]
        assert list(index.to_item_ids(np.array([truth[k] for k in known]))) == known

    for index in (ShardedIndex.open(uri, use_gpu=False), old):
        check(index)
        assert index.find("a/000") == -1 and index.find("a/001") == 1
    readded = items(["a/000", "a/005"], 9)  # removed items embedded again: new rows in a new shard
    commit_changes(uri, readded)
    compact(uri, 0.01)  # the shards with removals rewritten: rows move
    fresh = ShardedIndex.open(uri, use_gpu=False)
    for index in (fresh, old.refreshed(), served(uri, cache)):
        check(index)
        assert index.find("a/005") >= 0 and index.ntotal == fresh.ntotal
    with pytest.raises(index_search.IndexInputError, match=r"1 item id\(s\) are not in index .*'d/000'"):
        fresh.lookup(["a/001", "d/000"])


def test_item_ids_are_found_through_hash_collisions(tmp_path, monkeypatch):
    uri = grown_index(tmp_path)
    real = index_lookup.hash_ids
    monkeypatch.setattr(index_lookup, "hash_ids", lambda ids: real(ids) % np.uint64(3))  # 3 hashes in all
    monkeypatch.setattr(index_rows, "hash_ids", index_lookup.hash_ids)
    monkeypatch.setattr(index_rows, "hash_id", lambda item: hash_id(item) % 3)
    index = ShardedIndex.open(uri, use_gpu=False)
    truth = scan(index)
    assert [index.find(item) for item in ASKED] == [truth.get(item, -1) for item in ASKED]
    assert index.lookup(list(truth)).tolist() == list(truth.values())


@pytest.mark.parametrize("kind", ["ivf_flat", "ivf_pq"])
def test_on_disk_lists_give_exactly_the_in_memory_results(tmp_path, kind):
    uri = grown_index(tmp_path, kind)
    memory = ShardedIndex.open(uri, use_gpu=False, nprobe=4)
    cache = LocalCache(str(tmp_path / "cache"))
    disk = served(uri, cache, on_disk=True)
    lists = [faiss.extract_index_ivf(s.cpu_index).invlists for s in disk._loaded]
    assert all(isinstance(faiss.downcast_InvertedLists(il), faiss.OnDiskInvertedLists) for il in lists)
    assert sorted(n for n in os.listdir(cache.folder) if n.endswith(".ivfdata")) == \
        sorted(n for s in disk._loaded for n in s.files if n.endswith(".ivfdata"))
    q = vectors(300, 7)
    rng = np.random.default_rng(0)
    masks = [None, rng.random(memory.ntotal) < 0.3, memory.live & (np.arange(memory.ntotal) % 7 == 0)]
    for allowed in masks:
        for nprobe in (1, 4, 8):
            want = memory.search_ids(q, 10, nprobe=nprobe, allowed=allowed)
            got = disk.search_ids(q, 10, nprobe=nprobe, allowed=allowed)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
    assert not set(disk.search_ids(q, 20)[1].ravel()) & set(np.flatnonzero(~disk.live))  # removed: never


def test_hit_fields_come_from_column_files_equal_to_the_stored_columns(tmp_path):
    uri = grown_index(tmp_path)
    cfg = IndexConfig(uri=uri, use_gpu=False, nprobe=8, cache_dir=str(tmp_path / "cache"))
    live = LiveIndex(cfg, None, DIM)
    index = live.state.index
    rows = np.flatnonzero(index.live)
    stored = index.table(HIT_COLUMNS + ["embedding"], missing_ok=True).take(pa.array(rows)).to_pylist()
    got = index.describe(rows, HIT_COLUMNS)
    assert got == [{c: row[c] for c in HIT_COLUMNS} for row in stored]  # nulls and absent columns: None
    for row, want in zip(rows.tolist(), stored, strict=True):
        np.testing.assert_array_equal(index.vector(row), want["embedding"])
    hit = live.search_item("c/007", 3, include_self=True)[0]
    assert hit["item_id"] == "c/007" and hit["metadata"] == {"price": 7.5} and hit["class_name"] == "class 3"
    assert live.search_vector(vectors(1, 3)[0], 5, datasets=("hats",))[0]["dataset"] == "hats"
    counts = Counter(s["dataset"] for s in stored)
    assert live.stats()["datasets"] == dict(sorted(counts.items())) and sum(counts.values()) == 384


def test_the_local_cache_keeps_only_what_the_served_state_uses(tmp_path):
    uri = grown_index(tmp_path)
    root = tmp_path / "cache"
    dead = root / f"{PREFIX}999999999-gone"  # a replica that died without cleaning up
    dead.mkdir(parents=True)
    cfg = IndexConfig(uri=uri, use_gpu=False, cache_dir=str(root), on_disk="always")
    live = LiveIndex(cfg, None, DIM)
    folder = Path(live._cache.folder)
    assert not dead.exists() and folder.parent == root

    def files() -> set[str]:
        return set(os.listdir(folder))

    assert files() == live.state.index.cache_files() and len(files()) == 10  # 5 column files, 5 lists
    before = live.state
    compact(uri, 0.01)
    assert live.refresh()
    assert files() == live.state.index.cache_files() and files() != before.index.cache_files()
    assert before.index.describe(np.array([2]), ["item_id"]) == [{"item_id": "a/002"}]  # still readable
    live._cache.close()
    assert not folder.exists()


def test_the_plan_puts_lists_on_disk_when_a_replica_share_exceeds_its_budget(tmp_path):
    uri = grown_index(tmp_path)
    base = [f"index.uri={uri}", "serve.image_queries=false"]
    small = plan_service(load_config(None, [*base, "serve.index_replica_memory_gb=0.00001"]))
    assert small.cfg.index.on_disk == "always" and "IVF lists memory-mapped" in small.partitions_reason
    roomy = plan_service(load_config(None, base))
    assert roomy.cfg.index.on_disk == "never" and "memory-mapped" not in roomy.partitions_reason
    tiny = "serve.index_replica_memory_gb=0.00001"
    forced = plan_service(load_config(None, [*base, "index.on_disk=never", tiny]))
    assert forced.cfg.index.on_disk == "never"


def test_the_service_plan_is_made_in_a_child_that_takes_torch_with_it(tmp_path):
    uri = grown_index(tmp_path)
    code = ("import sys\nfrom puma.serve.run import plan_apart\n"
            f"plan = plan_apart(None, ['index.uri={uri}', 'serve.image_queries=false'])\n"
            "print(plan.manifest.total, plan.cfg.index.on_disk, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == [str(read_manifest(uri).total), "never", "False"], out.stderr[-2000:]
    with pytest.raises(ServiceSetupError, match="no index at"):  # what the child sends back
        run._plan(None, [f"index.uri={tmp_path / 'none'}", "serve.image_queries=false"], False)
