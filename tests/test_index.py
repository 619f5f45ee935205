"""Sharded FAISS index: real FAISS, real files (and a real S3 server); small vectors, fast."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from puma.config import ConfigError, IndexConfig, load_config
from puma.index import (
    IndexInputError,
    IndexIntegrityError,
    ShardedIndex,
    add_items,
    add_shard,
    build_index,
    create_index,
    indexed_item_ids,
    plan_index,
    read_manifest,
    rebuild,
    verify,
)
from puma.index import backend as index_backend
from puma.index import build as index_build
from puma.index.plan import GB, auto_nlist

DIM = 24


def catalogue(n: int, prefix: str = "item", seed: int = 0, dim: int = DIM) -> tuple[pa.Table, np.ndarray]:
    """An embeddings table of n L2-normalised clustered vectors: (table, (n, dim) float32)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((20, dim)).astype(np.float32)
    labels = rng.integers(0, 20, n)
    x = centres[labels] + 0.5 * rng.standard_normal((n, dim)).astype(np.float32)  # (n, dim)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    table = pa.table({"item_id": [f"{prefix}/{i:05d}" for i in range(n)],
                      "embedding": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), dim),
                      "dataset": [prefix] * n, "label": labels.astype(np.int64)})
    return table, x


def exact_topk(x: np.ndarray, q: np.ndarray, k: int, metric: str = "ip") -> tuple[np.ndarray, np.ndarray]:
    index = faiss.IndexFlatIP(x.shape[1]) if metric == "ip" else faiss.IndexFlatL2(x.shape[1])
    index.add(x)
    return index.search(q, k)


def file_state(root: Path) -> dict[str, tuple[int, bytes]]:
    """mtime and bytes of every file under root."""
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- plan


def test_plan_picks_type_by_size_and_budget() -> None:
    cfg = IndexConfig(flat_max_items=10_000, memory_budget_gb=1.0)
    assert plan_index(cfg, 5_000, 128).index_type == "flat"
    big = plan_index(cfg, 1_000_000, 128)  # 1M x 128 float32 = 0.5 GB: IVF-Flat fits 1 GB
    assert (big.index_type, big.nlist, big.factory) == ("ivf_flat", 4096, "IVF4096,Flat")
    pq_plan = plan_index(IndexConfig(memory_budget_gb=0.1), 1_000_000, 128)  # only codes fit 0.1 GB
    assert pq_plan.index_type == "ivf_pq" and pq_plan.memory_bytes <= 0.1 * GB
    assert pq_plan.factory == f"IVF4096,PQ{pq_plan.pq_m}x8" and 128 % pq_plan.pq_m == 0
    with pytest.raises(IndexInputError, match="memory_budget_gb"):
        plan_index(IndexConfig(memory_budget_gb=0.001), 1_000_000, 128)
    with pytest.raises(IndexInputError, match="must divide"):
        plan_index(IndexConfig(index_type="ivf_pq", pq_m=5), 100_000, 128)


def test_nlist_rule_and_train_sample() -> None:
    assert auto_nlist(1_000_000) == 4096 and auto_nlist(10_000) == 256
    assert auto_nlist(1000) == 16  # 4*sqrt(1000)=126 -> 128, capped at 1000/39=25 -> 16
    plan = plan_index(IndexConfig(index_type="ivf_flat"), 1_000_000, 64)
    assert plan.train_sample == 64 * 4096
    assert plan_index(IndexConfig(index_type="ivf_flat"), 1000, 64).train_sample == 1000  # capped at N


def test_index_config_validates_and_overrides() -> None:
    cfg = load_config(None, ["index.index_type=ivf_pq", "index.nprobe=8", "index.shard_size=1000"])
    assert (cfg.index.index_type, cfg.index.nprobe, cfg.index.shard_size) == ("ivf_pq", 8, 1000)
    with pytest.raises(ConfigError, match="index.index_type"):
        IndexConfig(index_type="hnsw")


# ----------------------------------------------------------------------------- sharded = exact


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_sharded_flat_search_equals_one_exact_index(tmp_path: Path, metric: str) -> None:
    table, x = catalogue(1000)
    report = build_index(str(tmp_path), table, IndexConfig(index_type="flat", shard_size=170, metric=metric))
    assert report.added == 1000 and len(report.shards) == 6
    index = ShardedIndex.open(str(tmp_path))
    q = catalogue(40, seed=1)[1]  # (40, DIM) queries not in the index
    scores, ids = index.search_ids(q, 10)
    ref_scores, ref_ids = exact_topk(x, q, 10, metric)
    np.testing.assert_array_equal(ids, ref_ids)  # global ids = rows of the catalogue
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)
    _, item_ids = index.search(q, 10)
    assert item_ids[0, 0] == f"item/{ref_ids[0, 0]:05d}"


def test_ivf_shards_share_trained_quantizer_and_equal_one_ivf_index(tmp_path: Path) -> None:
    table, x = catalogue(3000)
    cfg = IndexConfig(index_type="ivf_pq", nlist=16, pq_m=6, shard_size=1100)
    build_index(str(tmp_path), table, cfg)
    trained = faiss.read_index(str(tmp_path / "trained.faiss"))
    centroids = trained.quantizer.reconstruct_n(0, 16)  # (16, DIM)
    codebook = faiss.vector_to_array(trained.pq.centroids)
    shard_files = sorted(tmp_path.glob("shards/*/index.faiss"))
    assert len(shard_files) == 3
    for path in shard_files:
        shard = faiss.read_index(str(path))
        np.testing.assert_array_equal(shard.quantizer.reconstruct_n(0, 16), centroids)
        np.testing.assert_array_equal(faiss.vector_to_array(shard.pq.centroids), codebook)
    one = faiss.read_index(str(tmp_path / "trained.faiss"))  # the same trained index, all vectors
    one.add_with_ids(x, np.arange(len(x), dtype=np.int64))
    one.nprobe = 4
    q = catalogue(30, seed=2)[1]
    ref_scores, ref_ids = one.search(q, 10)
    scores, ids = ShardedIndex.open(str(tmp_path), nprobe=4).search_ids(q, 10)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)


def test_search_by_item_id_uses_stored_embeddings_and_drops_self(tmp_path: Path) -> None:
    table, x = catalogue(600)
    build_index(str(tmp_path), table, IndexConfig(index_type="flat", shard_size=100))
    index = ShardedIndex.open(str(tmp_path))
    wanted = ["item/00007", "item/00450", "item/00123"]
    np.testing.assert_array_equal(index.embeddings(wanted), x[[7, 450, 123]])
    scores, item_ids = index.search_by_item_id(wanted, 5)
    ref_scores, ref_ids = exact_topk(x, x[[7, 450, 123]], 6)  # each item is its own first hit
    assert ref_ids[:, 0].tolist() == [7, 450, 123] and item_ids.shape == (3, 5)
    assert item_ids.tolist() == [[f"item/{i:05d}" for i in row[1:]] for row in ref_ids]
    np.testing.assert_allclose(scores, ref_scores[:, 1:], rtol=1e-5, atol=1e-5)
    with pytest.raises(IndexInputError, match="not in index"):
        index.search_by_item_id(["item/99999"], 5)


# ----------------------------------------------------------------------------- manifest, verify


def test_manifest_describes_the_index(tmp_path: Path) -> None:
    table, _ = catalogue(500)
    build_index(str(tmp_path), table, IndexConfig(index_type="flat", shard_size=200), model_id="ckpt-7")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert (manifest["model_id"], manifest["dim"], manifest["metric"]) == ("ckpt-7", DIM, "ip")
    assert (manifest["index_type"], manifest["factory"], manifest["total"]) == ("flat", "IDMap,Flat", 500)
    assert [s["count"] for s in manifest["shards"]] == [200, 200, 100]
    assert [s["id_start"] for s in manifest["shards"]] == [0, 200, 400]
    assert "faiss-cpu" in manifest["versions"] or "faiss-gpu" in manifest["versions"]
    rows = pq.read_table(tmp_path / manifest["shards"][1]["embeddings"]["path"])
    assert rows.column_names == ["index_id", "item_id", "embedding", "dataset", "label"]
    assert rows["index_id"].to_pylist() == list(range(200, 400))


def test_verify_passes_then_detects_tampering_and_missing_files(tmp_path: Path) -> None:
    table, _ = catalogue(400)
    build_index(str(tmp_path), table, IndexConfig(index_type="ivf_flat", nlist=8, shard_size=150))
    report = verify(str(tmp_path))
    assert report.ok and (report.shards, report.items, report.files_checked) == (3, 400, 7)
    victim = tmp_path / "shards" / "shard-00001" / "index.faiss"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    report = verify(str(tmp_path))
    assert not report.ok and any("shard-00001/index.faiss: sha256" in p for p in report.problems)
    with pytest.raises(IndexIntegrityError, match="shard-00001"):
        report.raise_if_bad()
    with pytest.raises(IndexIntegrityError, match="checksum"):
        ShardedIndex.open(str(tmp_path))
    (tmp_path / "shards" / "shard-00002" / "embeddings.parquet").unlink()
    assert any("shard-00002/embeddings.parquet: missing" in p for p in verify(str(tmp_path)).problems)


# ----------------------------------------------------------------------------- incremental, idempotent


def test_crash_mid_add_then_rerun_gives_every_item_exactly_once(tmp_path: Path, monkeypatch) -> None:
    uri = str(tmp_path)
    table, x = catalogue(500)
    create_index(uri, IndexConfig(index_type="ivf_flat", nlist=8, shard_size=200), x)
    real_write = index_build.write_manifest
    calls = {"n": 0}

    def crash_on_second_commit(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # shard-00001's files are written, its manifest commit is not
            raise RuntimeError("injected crash before the manifest")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(index_build, "write_manifest", crash_on_second_commit)
    with pytest.raises(RuntimeError, match="injected"):
        add_items(uri, table)
    monkeypatch.setattr(index_build, "write_manifest", real_write)
    assert read_manifest(uri).total == 200 and (tmp_path / "shards" / "shard-00001" / "index.faiss").exists()
    assert verify(uri).orphans and ShardedIndex.open(uri).ntotal == 200  # the orphan is ignored
    report = add_items(uri, table)  # the re-run
    assert (report.added, report.skipped_duplicates) == (300, 200)
    assert report.removed_orphans and report.shards == ["shard-00001", "shard-00002"]
    ids = indexed_item_ids(uri).to_pylist()
    assert sorted(ids) == sorted(table["item_id"].to_pylist()) and len(ids) == len(set(ids)) == 500
    final = verify(uri)
    assert final.ok and not final.orphans and final.items == 500


def test_second_catalogue_extends_without_touching_existing_shards(tmp_path: Path) -> None:
    uri = str(tmp_path)
    first, x1 = catalogue(300, prefix="cub")
    build_index(uri, first, IndexConfig(index_type="ivf_flat", nlist=8, shard_size=128), model_id="m1")
    before = file_state(tmp_path / "shards")
    second, x2 = catalogue(200, prefix="cars", seed=5)
    report = add_items(uri, second, model_id="m1", source="s3://bucket/cars")
    assert (report.added, report.total, report.shards) == (200, 500, ["shard-00003", "shard-00004"])
    after = file_state(tmp_path / "shards")
    assert all(after[name] == state for name, state in before.items())  # same bytes, same mtime
    index = ShardedIndex.open(uri, nprobe=8)  # nprobe = nlist: exhaustive, so self is the top hit
    _, top = index.search(np.concatenate([x1[:3], x2[:3]]), 1)
    assert top[:, 0].tolist() == [f"{p}/{i:05d}" for p in ("cub", "cars") for i in range(3)]
    assert read_manifest(uri).shards[-1].source == "s3://bucket/cars"
    with pytest.raises(IndexInputError, match="cannot join"):
        add_items(uri, catalogue(5, prefix="new")[0], model_id="m2")


def test_refreshed_loads_only_new_shards_and_equals_a_fresh_open(tmp_path: Path) -> None:
    """A served index picks up new shards: the loaded ones are kept (same objects), only the new ones
    are read, and the result searches exactly like the index opened from scratch; a rebuild (another
    trained index) is opened anew."""
    uri = str(tmp_path / "index")
    first, x1 = catalogue(300, prefix="cub")
    build_index(uri, first, IndexConfig(index_type="ivf_flat", nlist=8, shard_size=128), model_id="m1")
    served = ShardedIndex.open(uri, nprobe=4, use_gpu=False)
    assert served.refreshed() is served  # nothing new
    second, x2 = catalogue(200, prefix="cars", seed=5)
    add_items(uri, second, model_id="m1")
    reads = []
    real_read = index_backend.deserialize
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(index_backend, "deserialize", lambda data: reads.append(len(data)) or real_read(data))
        fresh = served.refreshed()
    assert len(reads) == 2 and fresh.reused_shards(served) == 3  # shard-00003 and shard-00004 only
    assert fresh._shards[:3] == served._shards and fresh.ntotal == 500 and served.ntotal == 300
    q = np.concatenate([x1[:20], x2[:20], catalogue(20, seed=9)[1]])
    reopened = ShardedIndex.open(uri, nprobe=4, use_gpu=False)
    for got, want in zip(fresh.search(q, 7), reopened.search(q, 7), strict=True):
        np.testing.assert_array_equal(got, want)
    assert fresh.lookup(["cars/00199"]).tolist() == [499]
    rebuild(uri, str(tmp_path / "other"), IndexConfig(index_type="flat"))
    other = ShardedIndex.open(str(tmp_path / "other"), use_gpu=False)
    assert fresh.refreshed(other.manifest).reused_shards(fresh) == 0  # another trained index: opened anew


def test_duplicate_item_ids_are_skipped_and_counted(tmp_path: Path) -> None:
    uri = str(tmp_path)
    table, x = catalogue(100)
    build_index(uri, table, IndexConfig(index_type="flat"))
    new, _ = catalogue(3, prefix="new", seed=9)
    batch = pa.concat_tables([new, new.slice(0, 1), table.slice(10, 1)])  # new/0 twice, item/10 indexed
    report = add_shard(uri, batch)
    assert (report.added, report.skipped_duplicates) == (3, 2)
    assert set(report.duplicate_examples) == {"new/00000", "item/00010"}
    ids = indexed_item_ids(uri).to_pylist()
    assert len(ids) == len(set(ids)) == 103
    assert add_shard(uri, batch).added == 0  # idempotent: nothing new, no shard
    assert len(read_manifest(uri).shards) == 2


def test_create_index_is_idempotent_and_rebuild_changes_type(tmp_path: Path) -> None:
    table, x = catalogue(800)
    src = str(tmp_path / "flat")
    build_index(src, table, IndexConfig(index_type="flat", shard_size=300))
    trained = (tmp_path / "flat" / "trained.faiss").read_bytes()
    create_index(src, IndexConfig(index_type="ivf_pq"), x)  # exists: kept, not retrained
    assert read_manifest(src).index_type == "flat"
    assert (tmp_path / "flat" / "trained.faiss").read_bytes() == trained
    report = rebuild(src, str(tmp_path / "ivf"), IndexConfig(index_type="ivf_flat", nlist=8))
    assert report.added == 800 and read_manifest(str(tmp_path / "ivf")).factory == "IVF8,Flat"
    assert verify(str(tmp_path / "ivf")).ok


def test_bad_inputs_raise_clear_errors(tmp_path: Path) -> None:
    uri = str(tmp_path)
    table, x = catalogue(50)
    with pytest.raises(IndexInputError, match="no index"):
        add_items(uri, table)
    build_index(uri, table, IndexConfig(index_type="flat"))
    with pytest.raises(IndexInputError, match="dimension 8"):
        add_items(uri, catalogue(5, prefix="d8", dim=8)[0])
    nan = x[:2].copy()
    nan[1, 0] = np.nan
    bad = pa.table({"item_id": ["n0", "n1"], "embedding": list(nan)})
    with pytest.raises(IndexInputError, match="NaN"):
        add_items(uri, bad)
    with pytest.raises(IndexInputError, match="lacks column"):
        add_items(uri, pa.table({"item_id": ["a"]}))
    with pytest.raises(IndexInputError, match="k must be"):
        ShardedIndex.open(uri).search(x[:1], 51)
    with pytest.raises(IndexInputError, match="at least"):
        create_index(str(tmp_path / "tiny"), IndexConfig(index_type="ivf_flat", nlist=64), x)


# ----------------------------------------------------------------------------- job


def test_search_job_writes_results(tmp_path: Path, capsys) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "jobs"))
    import search as search_job

    table, x = catalogue(200)
    build_index(str(tmp_path / "index"), table, IndexConfig(index_type="flat", shard_size=64))
    np.save(tmp_path / "q.npy", x[:2])
    out = tmp_path / "out.parquet"
    argv = ["--queries", str(tmp_path / "q.npy"), "--k", "3", "--out", str(out), "--verify",
            f"index.uri={tmp_path / 'index'}"]
    assert search_job.main(argv) == 0
    results = pq.read_table(out)
    assert results.num_rows == 6 and results["item_id"].to_pylist()[0] == "item/00000"
    assert str(out) in capsys.readouterr().out
    argv = ["--item-id", "item/00003", "--k", "2", "--out", str(out), f"index.uri={tmp_path / 'index'}"]
    assert search_job.main(argv) == 0 and "item/00003" not in pq.read_table(out)["item_id"].to_pylist()
    assert search_job.main(["--item-id", "nope", f"index.uri={tmp_path / 'index'}"]) == 2


# ----------------------------------------------------------------------------- S3


def test_index_on_s3_build_crash_rerun_search_verify(s3_storage: str, monkeypatch) -> None:
    uri = f"{s3_storage}/index-a"  # the session's real SeaweedFS server (tests/conftest.py)
    table, x = catalogue(300)
    create_index(uri, IndexConfig(index_type="flat", shard_size=100), x)
    real_write = index_build.write_manifest
    monkeypatch.setattr(index_build, "write_manifest", lambda *a, **k: (_ for _ in ()).throw(OSError("boom")))
    with pytest.raises(OSError, match="boom"):
        add_items(uri, table)
    monkeypatch.setattr(index_build, "write_manifest", real_write)
    assert len(verify(uri).orphans) == 1  # shard-00000 written on S3, not committed
    report = add_items(uri, table)
    assert report.added == 300 and len(report.removed_orphans) == 1
    assert verify(uri).ok and not verify(uri).orphans
    scores, ids = ShardedIndex.open(uri).search_ids(x[:5], 3)
    np.testing.assert_array_equal(ids, exact_topk(x, x[:5], 3)[1])


@pytest.mark.gpu
def test_gpu_training_and_search_match_cpu(tmp_path: Path) -> None:
    if faiss.get_num_gpus() == 0:
        pytest.skip("FAISS sees no GPU (needs faiss-gpu on a GPU machine)")
    table, x = catalogue(5000)
    build_index(str(tmp_path), table, IndexConfig(index_type="ivf_flat", nlist=32, shard_size=2000))
    q = catalogue(50, seed=3)[1]
    gpu = ShardedIndex.open(str(tmp_path), nprobe=32)
    cpu = ShardedIndex.open(str(tmp_path), nprobe=32, use_gpu=False)
    assert gpu.on_gpu and not cpu.on_gpu and index_backend.gpus_available(True)
    np.testing.assert_array_equal(gpu.search_ids(q, 10)[1], cpu.search_ids(q, 10)[1])
