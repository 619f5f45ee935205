"""Partitioned serving (puma.serve.partitions): N partitions holding disjoint shards answer every
query exactly as one index holding them all (hits, scores, ranks, filters, item queries), keep
doing so as shards are added and items removed, and the plan sizes the partition count.

Ray-free: the partitions are LiveIndexes in this process, merged by the same FanOut code the
ingress runs over deployment handles (puma.serve.fanout.PartitionedIndex).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from puma.config import IndexConfig
from puma.index import add_items, build_index, read_manifest
from puma.index.build import commit_changes
from puma.serve.errors import RequestError
from puma.serve.fanout import FanOut
from puma.serve.live_index import LiveIndex
from puma.serve.partitions import Partition, partitions_for, shard_number

DIM, SHARD = 16, 60
DATASETS, CATALOGUES = ("cub", "cars", "sop"), ("s3://b/shop_a", "s3://b/shop_b")


class LocalFanOut(FanOut):
    """FanOut over LiveIndexes in this process (the ingress uses deployment handles instead)."""

    def __init__(self, parts: list[LiveIndex]) -> None:
        self.parts = parts

    async def _all(self, method: str, *args) -> list:
        *args, _version = args if method not in ("stats", "health") else (*args, "")
        if method == "thumbnail":
            return [p.thumbnail(args[0]) if p.holds(args[0]) else None for p in self.parts]
        if method == "health":
            return [{"items": p.state.items, "version": "", "refused_update": p.refused} for p in self.parts]
        return [getattr(p, method)(*args) for p in self.parts]


def table(start: int, n: int, seed: int) -> pa.Table:
    x = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    ids = [f"item/{i:05d}" for i in range(start, start + n)]
    return pa.table({"item_id": ids, "embedding": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), DIM),
                     "dataset": [DATASETS[i % 3] for i in range(start, start + n)],
                     "label": np.arange(start, start + n) % 7,
                     "catalogue": [CATALOGUES[(i // 5) % 2] for i in range(start, start + n)]})


def served(uri: str, partitions: int) -> tuple[LiveIndex, LocalFanOut]:
    cfg = IndexConfig(uri=uri, use_gpu=False, nprobe=4)
    one = LiveIndex(cfg, "m", DIM)
    return one, LocalFanOut([LiveIndex(cfg, "m", DIM, partition=Partition(p, partitions))
                             for p in range(partitions)])


def check_queries(one: LiveIndex, fan: LocalFanOut, n: int, seed: int) -> int:
    """n random vector and item queries with random filters: identical answers; returns hits compared."""
    rng = np.random.default_rng(seed)
    ids = [i for i in one.state.index.to_item_ids(np.arange(one.state.index.ntotal)) if i]
    compared = 0
    for i in range(n):
        k = int(rng.integers(1, 25))
        datasets = tuple(rng.choice(DATASETS, int(rng.integers(0, 3)), replace=False).tolist())
        names = ["shop_a", CATALOGUES[1]]  # by folder name and by URI
        catalogues = tuple(rng.choice(names, int(rng.integers(0, 2)), replace=False).tolist())
        if i % 4 == 3:
            item, include_self = ids[int(rng.integers(len(ids)))], bool(i % 8 == 3)
            want = one.search_item(item, k, datasets, catalogues, include_self)
            got = asyncio.run(fan.search_item(item, k, datasets, catalogues, include_self, None, ""))
        else:
            q = rng.standard_normal(DIM).astype(np.float32)
            want = one.search_vector(q / np.linalg.norm(q), k, datasets, catalogues)
            got = asyncio.run(fan.search_vector(q / np.linalg.norm(q), k, datasets, catalogues, None, ""))
        assert got == want, f"query {i} (k={k}, {datasets}, {catalogues})"
        compared += len(want)
    return compared


@pytest.mark.parametrize("index_type", ["flat", "ivf_flat"])
def test_four_partitions_answer_1000_queries_exactly_like_one_index(tmp_path: Path, index_type: str):
    uri = str(tmp_path / "index")
    build_index(uri, table(0, 300, 0), IndexConfig(index_type=index_type, nlist=8, shard_size=SHARD),
                model_id="m")
    add_items(uri, table(300, 420, 1), model_id="m")  # 12 shards of 60
    one, fan = served(uri, 4)
    sizes = [p.state.items for p in fan.parts]
    assert sum(sizes) == one.state.items == 720 and min(sizes) == 180  # 3 shards each: disjoint, balanced
    assert check_queries(one, fan, 1000, seed=2) > 5000
    stats = asyncio.run(fan.stats_async())
    assert stats["items"] == 720 and stats["shards"] == 12 and stats["datasets"] == one.stats()["datasets"]
    assert stats["catalogues"] == one.stats()["catalogues"]
    assert asyncio.run(fan.health_async())["items"] == 720


def test_partitions_follow_new_shards_and_removals_and_refuse_like_one_index(tmp_path: Path):
    uri = str(tmp_path / "index")
    build_index(uri, table(0, 240, 0), IndexConfig(index_type="flat", shard_size=SHARD), model_id="m")
    one, fan = served(uri, 3)
    add_items(uri, table(240, 130, 3), model_id="m")  # shards 4..6: each lands in its partition
    gone = [0, 7, 61, 250, 369]  # global ids across shards old and new
    commit_changes(uri, remove=np.array(gone, np.int64))
    for index in (one, *fan.parts):
        assert index.refresh()
    assert one.state.items == 365 == sum(p.state.items for p in fan.parts)
    holders = [[p.holds(f"item/{i:05d}") for p in fan.parts] for i in range(370)]
    assert all(sum(h) == (0 if i in gone else 1) for i, h in enumerate(holders))  # removed: nowhere
    assert check_queries(one, fan, 200, seed=4) > 1000
    q = np.ones(DIM, np.float32) / 4
    for datasets, catalogues, status in ((("dogs",), (), 422), ((), ("nowhere",), 422)):
        with pytest.raises(RequestError) as want:
            one.search_vector(q, 5, datasets, catalogues)
        with pytest.raises(RequestError) as got:
            asyncio.run(fan.search_vector(q, 5, datasets, catalogues, None, ""))
        assert want.value.status == got.value.status == status
    with pytest.raises(RequestError) as missing:
        asyncio.run(fan.search_item("item/00007", 5, (), (), False, None, ""))
    assert missing.value.status == 404


def test_a_partition_without_shards_answers_empty_and_an_empty_index_is_503(tmp_path: Path):
    uri = str(tmp_path / "index")
    build_index(uri, table(0, 50, 0), IndexConfig(index_type="flat", shard_size=SHARD), model_id="m")
    one, fan = served(uri, 3)  # one shard: partitions 1 and 2 hold nothing
    assert [p.state.items for p in fan.parts] == [50, 0, 0]
    assert check_queries(one, fan, 50, seed=5) > 100
    commit_changes(uri, remove=np.arange(50, dtype=np.int64))
    for index in fan.parts:
        index.refresh()
    with pytest.raises(RequestError) as empty:
        asyncio.run(fan.search_vector(np.ones(DIM, np.float32) / 4, 5, (), (), None, ""))
    assert empty.value.status == 503


def test_the_plan_picks_partitions_from_size_and_budget(tmp_path: Path):
    uri = str(tmp_path / "index")
    build_index(uri, table(0, 600, 0), IndexConfig(index_type="flat", shard_size=SHARD), model_id="m")
    manifest = read_manifest(uri)
    assert partitions_for(manifest, 3, 8.0)[0] == 3
    count, why = partitions_for(manifest, 0, 8.0)
    assert count == 1 and "serve.index_replica_memory_gb=8 -> 1 partition" in why
    files = sum(s.index.bytes for s in manifest.shards) + manifest.trained.bytes
    need = files * 1.2 + 600 * 88  # FAISS with headroom and 88 B per item (puma.serve.partitions)
    count, why = partitions_for(manifest, 0, need / 4 / 1e9 * 1.01)
    assert count == 4 and "10 shard(s)" in why
    assert partitions_for(manifest, 0, 1e-9)[0] == 10  # never more partitions than shards
    assert [shard_number(s.name) % 4 for s in manifest.shards] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
