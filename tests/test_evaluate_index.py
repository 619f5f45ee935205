"""Evaluation through the sharded index equals the core metrics (exact index) and approximates them (IVF).

The last test runs ``jobs/evaluate.py --embed`` end to end: a prepared dataset of real images, a
tiny checkpoint (tests/tiny.py), the embedding job on the test Ray cluster, then the metrics.
"""

from __future__ import annotations

import json
from pathlib import Path

import faiss.contrib.torch_utils  # noqa: F401 - as pytorch-metric-learning does: patches Index.search
import numpy as np
import pyarrow as pa
import pytest
from tiny import make_checkpoint, reference_embeddings

import jobs.evaluate
from puma import storage
from puma.checkpoint import checkpoint_id
from puma.config import IndexConfig
from puma.data.manifest import load_manifest
from puma.data.prepare import prepare
from puma.data.sources import SourceSpec
from puma.eval import RetrievalInputError, evaluate_embeddings
from puma.eval.index_eval import evaluate_index
from puma.index import ShardedIndex, build_index, read_manifest
from puma.index.table import read_columns, read_table
from puma.index.versions import resolve, version_name, version_uri

DIM = 16
KS = (1, 2, 4, 8)
REPO = Path(__file__).resolve().parent.parent
FLOWERS = REPO.parent / "shared" / "data" / "flowers12-subset"
if not FLOWERS.exists():
    FLOWERS = Path("/work/shared/data/flowers12-subset")


def clustered_catalogue(seed: int = 0) -> tuple[pa.Table, dict[str, np.ndarray]]:
    """Three datasets, shuffled together: two all-vs-all (same class numbers) and an In-Shop-like one."""
    rng = np.random.default_rng(seed)
    parts = []
    specs = (("birds", 12, 8, 0.9), ("flowers", 10, 10, 0.7), ("shop", 15, 5, 0.8))
    for name, classes, per_class, noise in specs:
        labels = np.repeat(np.arange(classes), per_class)  # (n,)
        centres = rng.standard_normal((classes, DIM))
        x = centres[labels] + noise * rng.standard_normal((len(labels), DIM))
        roles = np.array(["query"] * len(labels), dtype=object)
        if name == "shop":  # In-Shop: 2 queries per class, the rest gallery; a few gallery-only classes
            roles = np.where(np.arange(len(labels)) % per_class < 2, "query", "gallery").astype(object)
            roles[labels >= 13] = "gallery"
        parts.append((name, labels, x, roles))
    labels = np.concatenate([p[1] for p in parts]).astype(np.int64)
    x = np.concatenate([p[2] for p in parts]).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    datasets = np.concatenate([[p[0]] * len(p[1]) for p in parts]).astype(str)
    roles = np.concatenate([p[3] for p in parts]).astype(str)
    order = rng.permutation(len(labels))  # datasets interleave across shards
    cols = {"emb": x[order], "labels": labels[order], "datasets": datasets[order], "roles": roles[order]}
    n = len(order)
    table = pa.table({"item_id": [f"{d}/{i:04d}" for i, d in enumerate(cols["datasets"])],
                      "embedding": pa.FixedSizeListArray.from_arrays(pa.array(cols["emb"].ravel()), DIM),
                      "dataset": cols["datasets"], "label": cols["labels"], "role": cols["roles"],
                      "catalogue": ["synthetic"] * n, "image_uri": [""] * n, "image_row": np.full(n, -1)})
    return table, cols


def with_labels(table: pa.Table, labels: np.ndarray) -> pa.Table:
    return table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels))


def exact(cols: dict[str, np.ndarray]) -> dict[str, float]:
    return evaluate_embeddings(cols["emb"], cols["labels"], cols["datasets"], cols["roles"], ks=KS)


def test_flat_sharded_index_equals_core_metrics(tmp_path: Path) -> None:
    table, cols = clustered_catalogue()
    uri = str(tmp_path / "index")
    build_index(uri, table, IndexConfig(index_type="flat", shard_size=70))  # 271 items -> 4 shards
    assert len(ShardedIndex.open(uri).manifest.shards) == 4
    want = exact(cols)
    got = evaluate_index(uri, ks=KS, chunk=37)  # chunking crosses shard and dataset boundaries
    assert set(got) == set(want)
    assert {"shop/r@1", "unified/map@r", "harmonic/r@1", "birds/rp"} <= set(got)
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-6), key
    assert 0.2 < want["harmonic/r@1"] < 1.0  # not a degenerate all-0 / all-1 case


def test_ivf_index_all_lists_exact_few_lists_close(tmp_path: Path) -> None:
    table, cols = clustered_catalogue(seed=1)
    uri = str(tmp_path / "ivf")
    build_index(uri, table, IndexConfig(index_type="ivf_flat", nlist=4, shard_size=100))
    want = exact(cols)
    all_lists = evaluate_index(uri, ks=KS, nprobe=4)  # every list probed: exhaustive
    for key in want:
        assert all_lists[key] == pytest.approx(want[key], abs=1e-6), key
    one_list = evaluate_index(uri, ks=KS, nprobe=1)
    assert set(one_list) == set(want)
    for key in ("unified/r@1", "unified/map@r", "harmonic/r@1"):
        assert abs(one_list[key] - want[key]) < 0.1, key
    assert one_list != all_lists  # one list of four really is approximate here


def test_unlabelled_rows_and_missing_columns_are_refused(tmp_path: Path) -> None:
    table, _ = clustered_catalogue()
    labels = table["label"].to_numpy().copy()
    labels[[3, 5]] = -1
    build_index(str(tmp_path / "a"), with_labels(table, labels), IndexConfig(index_type="flat"))
    with pytest.raises(RetrievalInputError, match=r"2 row\(s\) have label -1"):
        evaluate_index(str(tmp_path / "a"))
    build_index(str(tmp_path / "b"), table.drop_columns(["role"]), IndexConfig(index_type="flat"))
    with pytest.raises(RetrievalInputError, match=r"lacks column\(s\) \['role'\]"):
        evaluate_index(str(tmp_path / "b"))


def test_restricted_search_returns_only_allowed_ids(tmp_path: Path) -> None:
    table, cols = clustered_catalogue()
    uri = str(tmp_path / "index")
    build_index(uri, table, IndexConfig(index_type="flat", shard_size=70))
    index = ShardedIndex.open(uri, use_gpu=False)
    allowed = cols["datasets"] == "flowers"
    _, ids = index.search_ids(cols["emb"][:5], 10, allowed=allowed)
    assert allowed[ids].all()
    want = np.argsort(-(cols["emb"][:5] @ cols["emb"][allowed].T), axis=1)[:, :10]  # exact, within flowers
    np.testing.assert_array_equal(ids, np.flatnonzero(allowed)[want])
    _, few = index.search_ids(cols["emb"][:2], 5, allowed=np.arange(len(allowed)) < 3)  # 3 allowed, k 5
    assert (few[:, 3:] == -1).all() and set(few[0, :3]) == {0, 1, 2}


def test_evaluate_job_end_to_end(tmp_path: Path, capsys) -> None:
    evaluate_job = jobs.evaluate
    table, cols = clustered_catalogue()
    uri = str(tmp_path / "index")
    build_index(uri, table, IndexConfig(index_type="flat", shard_size=100))
    assert evaluate_job.main([f"index.uri={uri}", "eval.ks=[1,4]"]) == 0
    out = capsys.readouterr().out
    for row in ("birds", "flowers", "shop", "unified", "harmonic"):
        assert row in out
    record = json.loads((tmp_path / "index" / "evaluation.json").read_text())
    want = evaluate_embeddings(cols["emb"], cols["labels"], cols["datasets"], cols["roles"], ks=(1, 4))
    assert record["metrics"]["harmonic/r@1"] == pytest.approx(want["harmonic/r@1"], abs=1e-6)
    assert f"{want['harmonic/r@1']:.4f}" in out and record["items"] == len(table) and record["shards"] == 3
    other = tmp_path / "m.json"
    assert evaluate_job.main(["--index", uri, "--out", str(other)]) == 0 and other.exists()
    labels = table["label"].to_numpy().copy()
    labels[0] = -1
    build_index(str(tmp_path / "bad"), with_labels(table, labels), IndexConfig(index_type="flat"))
    assert evaluate_job.main(["--index", str(tmp_path / "bad")]) == 2
    assert "label -1" in capsys.readouterr().err


def flower_folder(root: Path, classes: int = 4, per_class: int = 4) -> Path:
    """A class-per-folder tree of real Oxford-Flowers photos: the first ``classes`` species."""
    for species in sorted(p for p in FLOWERS.iterdir() if p.is_dir())[:classes]:
        (root / species.name).mkdir(parents=True)
        for photo in sorted(species.glob("*.jpg"))[:per_class]:
            (root / species.name / photo.name).write_bytes(photo.read_bytes())
    return root


def prepared_test_split(prepared: str) -> pa.Table:
    """The prepared test split's rows (no image bytes), with where each image is: the reference."""
    tables = []
    for shard in load_manifest(prepared).shard_uris("test"):
        cols = read_columns(shard, ["item_id", "dataset", "label", "role"])
        tables.append(cols.append_column("image_uri", pa.array([shard] * len(cols)))
                      .append_column("image_row", pa.array(np.arange(len(cols), dtype=np.int64))))
    return pa.concat_tables(tables)


@pytest.mark.budget(150)  # embeds the test split with Ray Data, then evaluates (31-34 s; 94 s on CI)
def test_evaluate_job_embeds_the_test_split_and_equals_core_metrics(ray_cluster, cub_tree, tmp_path, capsys):
    """`jobs/evaluate.py --embed`: real images -> tiny checkpoint -> index -> the core metrics, to 1e-5."""
    cub_tree(tmp_path / "raw_cub", num_classes=4, per_class=4)
    specs = [SourceSpec("cub", "cub", str(tmp_path / "raw_cub")),
             SourceSpec("folder", "flowers", str(flower_folder(tmp_path / "raw_flowers")))]
    prepared = str(tmp_path / "prepared")
    prepare(specs, prepared, shard_rows=5, log=lambda _: None)  # test split: 2 x 8 items, 4 shards
    checkpoint = make_checkpoint(str(tmp_path / "ckpt" / "best"))
    index = str(tmp_path / "index")
    argv = ["--embed", "--index", index, "--checkpoint", checkpoint, f"data.uri={prepared}",
            "eval.ks=[1,2,4]", "embed.commit_rows=6", "embed.batch_size=4", "data.decode_batch_size=4",
            "embed.num_cpus=1"]
    assert jobs.evaluate.main(argv) == 0
    out = capsys.readouterr().out
    assert f"embedded 16 test images of {prepared} into {resolve(index)}" in out

    refs = prepared_test_split(prepared)
    stored = read_table(storage.join(resolve(index), "shards"))
    assert len(refs) == 16 and sorted(stored["item_id"].to_pylist()) == sorted(refs["item_id"].to_pylist())
    meta = ["item_id", "dataset", "label", "role"]
    by_id = {r["item_id"]: r for r in stored.select(meta).to_pylist()}
    assert [by_id[i] for i in refs["item_id"].to_pylist()] == refs.select(meta).to_pylist()
    manifest = read_manifest(resolve(index))
    assert (manifest.index_type, manifest.total, [s.count for s in manifest.shards]) == ("flat", 16, [8, 8])

    emb = reference_embeddings(checkpoint, refs)  # (16, E), in-process forward of the eval views
    row_of = {item: row for row, item in enumerate(stored["item_id"].to_pylist())}
    rows = [row_of[i] for i in refs["item_id"].to_pylist()]
    got = np.stack(stored["embedding"].to_numpy(zero_copy_only=False))[rows]  # (16, E) in reference order
    np.testing.assert_allclose(got, emb, atol=1e-5)
    want = evaluate_embeddings(emb, refs["label"].to_numpy(), np.asarray(refs["dataset"].to_pylist()),
                               np.asarray(refs["role"].to_pylist()), ks=(1, 2, 4))
    record = json.loads(Path(index, "evaluation.json").read_text())
    assert set(record["metrics"]) == set(want) and {"cub/r@4", "flowers/map@r", "harmonic/rp"} <= set(want)
    for key, value in want.items():
        assert record["metrics"][key] == pytest.approx(value, abs=1e-5), key
    for row in ("cub", "flowers", "unified"):
        line = next(x for x in out.splitlines() if x.startswith(row + " "))
        assert line.split()[1:] == [f"{want[f'{row}/{m}']:.4f}" for m in ("r@1", "map@r", "rp")]

    assert jobs.evaluate.main(argv) == 0  # again: nothing re-embedded, the same metrics
    assert "embedded 0 test images" in capsys.readouterr().out
    assert json.loads(Path(index, "evaluation.json").read_text())["metrics"] == record["metrics"]
    other = make_checkpoint(str(tmp_path / "other" / "best"), seed=3)  # --embed with another model:
    argv[argv.index(checkpoint)] = other  # its own version is built and evaluated, not the live one
    assert jobs.evaluate.main(argv) == 0
    again = json.loads(Path(index, "evaluation.json").read_text())
    assert again["index"] == version_uri(index, version_name(checkpoint_id(other)))
    assert again["metrics"] != record["metrics"] and record["index"] == resolve(index)
