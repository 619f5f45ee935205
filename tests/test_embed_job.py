"""The batch embedding job (puma/inference, jobs/embed.py) on a real local Ray, real FAISS, real S3.

A tiny checkpoint is built in-process (tests/tiny.py, real save_checkpoint); catalogues are image
folders (real Oxford-Flowers photos from ../shared/data plus generated ones) and a prepared
Parquet dataset.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import encode_image, special_images, write_cub_tree
from tiny import make_checkpoint, reference_embeddings

import jobs.embed
from puma import storage
from puma.config import load_config
from puma.data.prepare import prepare
from puma.data.rejects import read_rejects
from puma.data.sources import SourceSpec
from puma.index import ShardedIndex, read_manifest, verify
from puma.index.build import live_table
from puma.index.table import read_table
from puma.index.versions import read_alias, resolve, version_name
from puma.inference import embed_catalogue, watch
from puma.inference.job import checkpoint_id

REPO = Path(__file__).resolve().parent.parent
FLOWERS = REPO.parent / "shared" / "data" / "flowers12-subset"
if not FLOWERS.exists():
    FLOWERS = Path("/work/shared/data/flowers12-subset")
EMBED_JOB = REPO / "jobs" / "embed.py"


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "best"))


def image_catalogue(root: Path, name: str, n_real: int, n_generated: int, bad: bool = False) -> Path:
    """A folder of images: real flower photos, generated JPEG/PNGs in a sub-folder, optionally bad ones."""
    folder = root / name
    photos = sorted(FLOWERS.glob("*/*.jpg"))[: n_real]
    for i, photo in enumerate(photos):
        (folder / photo.parent.name).mkdir(parents=True, exist_ok=True)
        (folder / photo.parent.name / f"{name}_{i}.jpg").write_bytes(photo.read_bytes())
    (folder / "gen").mkdir(parents=True, exist_ok=True)
    seed = zlib.crc32(name.encode())  # catalogues differ in their generated images
    for i in range(n_generated):
        (folder / "gen" / f"{i:03d}.png").write_bytes(encode_image(fmt="PNG", size=(48, 40), seed=seed + i))
    if bad:
        for kind, (data, _) in special_images().items():
            (folder / "bad" / f"{kind}.png").parent.mkdir(exist_ok=True)
            (folder / "bad" / f"{kind}.png").write_bytes(data)
        (folder / "README.txt").write_text("not an image: ignored and counted")
    return folder


def embed_cfg(root: Path, checkpoint: str, *overrides: str):
    return load_config(None, [f"index.uri={root / 'index'}", f"embed.checkpoint={checkpoint}",
                              "embed.commit_rows=8", "embed.batch_size=4", "data.decode_batch_size=4",
                              "embed.num_cpus=1", *overrides])


def stored(index_uri: str) -> pa.Table:
    """Every committed embeddings row of the index (its live version)."""
    return read_table(storage.join(resolve(index_uri), "shards"))


def stored_live(index_uri: str) -> dict[str, dict]:
    """The live rows of the index's live version by item id (embeddings left out)."""
    table = live_table(resolve(index_uri)).drop_columns(["embedding"])
    return {r["item_id"]: r for r in table.to_pylist()}


def live_dir(index: Path) -> Path:
    """The folder of the live version of the index location ``index``."""
    return Path(resolve(str(index)))


def committed_items(index: Path) -> int:
    """Items committed to the live version so far (0 before the first commit)."""
    try:
        return read_manifest(resolve(str(index))).total
    except (FileNotFoundError, ValueError):
        return 0


# ----------------------------------------------------------------------------- tests


def test_decoding_in_the_embedding_actor_gives_the_same_embeddings(ray_cluster, checkpoint, tmp_path):
    """data.decode_on=worker on CPU actors: the JPEGs decoded by the actor (libjpeg-turbo, PIL's resampling
    weights), the PNGs viewed by the tasks, the same embeddings as the tasks' PIL views."""
    folder = image_catalogue(tmp_path, "mixed", n_real=6, n_generated=5)
    report = embed_catalogue(embed_cfg(tmp_path, checkpoint, "data.decode_on=worker"), str(folder))
    assert (report.embedded, report.rejected) == (11, 0)
    table = stored(str(tmp_path / "index"))
    emb = np.stack(table["embedding"].to_numpy(zero_copy_only=False))
    assert (emb * reference_embeddings(checkpoint, table)).sum(1).min() >= 0.9999


def test_embeddings_equal_the_model_forward_for_folders_and_prepared_data(ray_cluster, checkpoint, tmp_path):
    folder = image_catalogue(tmp_path, "flowers_a", n_real=6, n_generated=5)
    write_cub_tree(tmp_path / "raw_cub", num_classes=3, per_class=3)
    prepare([SourceSpec("cub", "cub", str(tmp_path / "raw_cub"))], str(tmp_path / "prepared"), shard_rows=4,
            log=lambda _: None)
    cfg = embed_cfg(tmp_path, checkpoint)
    a = embed_catalogue(cfg, str(folder))
    b = embed_catalogue(cfg, str(tmp_path / "prepared"))
    assert (a.embedded, a.rejected, b.embedded, b.rejected) == (11, 0, 9, 0)
    table = stored(str(tmp_path / "index"))
    assert len(table) == 20 and table["embedding"].type.value_type == pa.float32()
    emb = np.stack(table["embedding"].to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(emb, reference_embeddings(checkpoint, table), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    rows = {r["item_id"]: r for r in table.drop_columns(["embedding"]).to_pylist()}
    flower = rows["flowers_a/gen/000.png"]
    assert (flower["dataset"], flower["label"], flower["role"], flower["image_row"]) == (
        "flowers_a", -1, "gallery", -1)
    assert flower["image_uri"] == str(folder / "gen" / "000.png") and flower["catalogue"] == str(folder)
    cub = [r for r in rows.values() if r["dataset"] == "cub"]
    assert {r["role"] for r in cub} <= {"train", "query"} and all(r["image_row"] >= 0 for r in cub)
    assert {r["label"] for r in cub} == {0, 1, 2}
    manifest = read_manifest(resolve(str(tmp_path / "index")))
    assert manifest.model_id == checkpoint_id(checkpoint) and manifest.model_id.startswith("sha256:")
    assert manifest.index_type == "flat" and manifest.total == 20
    assert verify(resolve(str(tmp_path / "index"))).ok


def test_crash_mid_commit_then_rerun_gives_every_item_exactly_once(ray_cluster, checkpoint, tmp_path,
                                                                    monkeypatch):
    folder = image_catalogue(tmp_path, "cat", n_real=4, n_generated=26)  # 30 items, commits of 8
    cfg = embed_cfg(tmp_path, checkpoint)
    index = str(tmp_path / "index")
    import puma.index.build as build

    real_write, calls = build.write_manifest, []

    def crash_on_second_shard(uri, manifest):  # 1: create, 2: shard 0 committed, 3: dies before commit
        calls.append(len(manifest.shards))
        if len(calls) == 3:
            raise RuntimeError("injected crash between shard files and manifest")
        real_write(uri, manifest)

    monkeypatch.setattr(build, "write_manifest", crash_on_second_shard)
    with pytest.raises(RuntimeError, match="injected crash"):
        embed_catalogue(cfg, str(folder))
    monkeypatch.setattr(build, "write_manifest", real_write)
    first = read_manifest(resolve(index)).total  # one commit: >= commit_rows (8) items, batches of <= 4
    assert 8 <= first < 12
    assert (live_dir(tmp_path / "index") / "shards" / "shard-00001").exists()  # unfinished shard left behind

    report = embed_catalogue(cfg, str(folder))
    assert (report.skipped_indexed, report.embedded, report.total) == (first, 30 - first, 30)
    ids = stored(index)["item_id"].to_pylist()
    assert len(ids) == len(set(ids)) == 30
    manifest = read_manifest(resolve(index))
    assert manifest.total == sum(s.count for s in manifest.shards) == 30
    counts = [s.count for s in manifest.shards]
    assert counts[0] == first and all(8 <= c < 12 for c in counts[:-1]) and 0 < counts[-1] < 12, counts
    shard_dirs = sorted(os.listdir(live_dir(tmp_path / "index") / "shards"))
    assert shard_dirs == [s.name for s in manifest.shards]  # the unfinished shard was removed
    assert verify(resolve(index)).ok
    assert ShardedIndex.open(index, use_gpu=False).ntotal == 30


def test_killed_job_process_then_rerun_gives_every_item_exactly_once(ray_cluster, checkpoint, tmp_path):
    """SIGKILL a real `jobs/embed.py` driver (joined to the test's Ray) after its first commit."""
    folder = image_catalogue(tmp_path, "cat", n_real=0, n_generated=60)
    index = tmp_path / "index"
    args = [sys.executable, str(EMBED_JOB), "--catalogue", str(folder), f"index.uri={index}",
            f"embed.checkpoint={checkpoint}", "embed.commit_rows=4", "embed.batch_size=2",
            "data.decode_batch_size=2", "embed.num_cpus=1"]
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address,
           "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if committed_items(index):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait(timeout=30)
    committed = read_manifest(resolve(str(index))).total
    assert 4 <= committed < 60, f"not killed mid-way ({committed} committed, rc {proc.returncode})"
    report = embed_catalogue(embed_cfg(tmp_path, checkpoint), str(folder))
    assert report.skipped_indexed == committed and report.embedded == 60 - committed
    ids = stored(str(index))["item_id"].to_pylist()
    assert len(ids) == len(set(ids)) == 60 and read_manifest(resolve(str(index))).total == 60
    assert verify(resolve(str(index))).ok


@pytest.mark.budget(100)  # an IVF index trained on a committed sample, then the rest embedded (30-46 s)
def test_ivf_index_is_trained_once_on_a_sample_that_is_committed_first(ray_cluster, checkpoint, tmp_path):
    first = image_catalogue(tmp_path, "ivf_a", n_real=2, n_generated=48)
    second = image_catalogue(tmp_path, "ivf_b", n_real=0, n_generated=6)
    cfg = embed_cfg(tmp_path, checkpoint, "index.index_type=ivf_flat", "index.nlist=1",
                    "index.train_sample=40", "index.nprobe=1", "embed.commit_rows=100")
    index = str(tmp_path / "index")
    r1, r2 = embed_catalogue(cfg, str(first)), embed_catalogue(cfg, str(second))
    manifest = read_manifest(resolve(index))
    assert (manifest.index_type, manifest.nlist, manifest.train_count) == ("ivf_flat", 1, 40)
    assert [s.count for s in manifest.shards] == [40, 10, 6]  # the training sample, the rest, catalogue 2
    assert (r1.embedded, r2.embedded, manifest.total) == (50, 6, 56) and verify(resolve(index)).ok
    ids = stored(index)["item_id"].to_pylist()
    assert len(set(ids)) == 56
    table = stored(index)
    emb = np.stack(table["embedding"].to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(emb, reference_embeddings(checkpoint, table), atol=1e-5)
    searcher = ShardedIndex.open(index, nprobe=1, use_gpu=False)
    _, found = searcher.search(searcher.embeddings(["ivf_a/gen/001.png", "ivf_b/gen/002.png"]), k=1)
    assert list(found[:, 0]) == ["ivf_a/gen/001.png", "ivf_b/gen/002.png"]


def test_second_catalogue_is_added_without_re_embedding_the_first(ray_cluster, checkpoint, tmp_path):
    first = image_catalogue(tmp_path, "first", n_real=5, n_generated=7)
    second = image_catalogue(tmp_path, "second", n_real=0, n_generated=9)
    cfg = embed_cfg(tmp_path, checkpoint)
    index = str(tmp_path / "index")
    r1 = embed_catalogue(cfg, str(first))
    before = {p: p.read_bytes() for p in (live_dir(tmp_path / "index") / "shards").rglob("*") if p.is_file()}
    r2 = embed_catalogue(cfg, str(second))
    r3 = embed_catalogue(cfg, str(first))  # nothing new: no read, no decode, no model
    assert (r1.embedded, r2.embedded, r2.skipped_indexed) == (12, 9, 0)
    assert (r3.embedded, r3.skipped_indexed, r3.shards_added, r3.total) == (0, 12, [], 21)
    assert all(p.read_bytes() == data for p, data in before.items())  # first shards byte-identical
    assert set(r2.shards_added).isdisjoint(r1.shards_added)
    searcher = ShardedIndex.open(index, use_gpu=False)
    queries = ["first/gen/003.png", "second/gen/004.png"]
    scores, found = searcher.search(searcher.embeddings(queries), k=1)
    assert list(found[:, 0]) == queries and np.all(scores[:, 0] > 0.999)


def test_unreadable_images_are_rejected_and_listed_and_the_job_completes(ray_cluster, checkpoint, tmp_path,
                                                                         capsys):
    folder = image_catalogue(tmp_path, "mixed", n_real=2, n_generated=3, bad=True)
    rc = jobs.embed.main(["--catalogue", str(folder), f"index.uri={tmp_path / 'index'}",
                          f"embed.checkpoint={checkpoint}", "embed.commit_rows=8", "embed.num_cpus=1"])
    out = capsys.readouterr().out
    rejects_file = tmp_path / "index" / "rejects" / "mixed.jsonl"
    assert rc == 0 and "3 rejected image(s) listed in" in out and str(rejects_file) in out
    rows = {r["item_id"]: r["reason"] for r in read_rejects(str(rejects_file))}
    assert rows == {"mixed/bad/corrupt.png": "corrupt", "mixed/bad/truncated.png": "truncated",
                    "mixed/bad/tiny.png": "tiny"}
    ids = set(stored(str(tmp_path / "index"))["item_id"].to_pylist())
    assert {"mixed/bad/cmyk.png", "mixed/bad/palette.png", "mixed/bad/grayscale.png"} <= ids
    assert len(ids) == 2 + 3 + 3 and not set(rows) & ids
    report = embed_catalogue(embed_cfg(tmp_path, checkpoint), str(folder))  # rejects are not re-tried
    assert (report.embedded, report.skipped_rejected, report.rejected) == (0, 3, 3)
    other = make_checkpoint(str(tmp_path / "other"), seed=1)  # another model never joins this version
    assert checkpoint_id(other) != checkpoint_id(checkpoint)
    assert checkpoint_id(make_checkpoint(str(tmp_path / "copy"))) == checkpoint_id(checkpoint)
    rc = jobs.embed.main(["--catalogue", str(folder), f"index.uri={tmp_path / 'index'}",
                          f"embed.checkpoint={other}"])
    alias = read_alias(str(tmp_path / "index"))  # it builds its own version, which then goes live
    assert rc == 0 and (alias.live, alias.previous) == (version_name(checkpoint_id(other)),
                                                        version_name(checkpoint_id(checkpoint)))


def test_a_prepared_catalogue_lists_prepares_rejects_beside_its_own(ray_cluster, checkpoint, tmp_path):
    special = {name: data for name, (data, _) in special_images().items()}
    kinds = write_cub_tree(tmp_path / "raw", num_classes=2, per_class=2, special=special, missing=("gone",))
    prepared = tmp_path / "prepared"
    prepare([SourceSpec("cub", "cub", str(tmp_path / "raw"))], str(prepared), shard_rows=4,
            log=lambda _: None)
    at_prepare = {i: ("missing_file" if k == "missing" else k) for i, k in kinds.items()
                  if k in ("missing", "corrupt", "truncated")}
    assert {r["item_id"]: r["reason"] for r in read_rejects(str(prepared / "rejects" / "prepare.jsonl"))} \
        == at_prepare  # found once, by prepare: never in a shard
    report = embed_catalogue(embed_cfg(tmp_path, checkpoint), str(prepared))
    rows = read_rejects(report.rejects_uri)
    assert {r["item_id"]: r["stage"] for r in rows} == {**{i: "prepare" for i in at_prepare},
                                                       "cub/images/002.Class_2/tiny.png": "decode"}
    assert report.rejected == 4 and report.reject_reasons == {"corrupt": 1, "missing_file": 1, "tiny": 1,
                                                              "truncated": 1}
    assert report.embedded == len(kinds) - 4  # cmyk, palette and grayscale included
    text = Path(report.rejects_uri).read_text()
    again = embed_catalogue(embed_cfg(tmp_path, checkpoint), str(prepared))  # a re-run adds nothing
    assert (again.embedded, again.rejected) == (0, 4) and Path(report.rejects_uri).read_text() == text


@pytest.mark.budget(120)  # --watch: three polls, two catalogues embedded (37-59 s)
def test_watch_embeds_each_new_catalogue_once(ray_cluster, checkpoint, tmp_path, capsys):
    prefix = tmp_path / "catalogues"
    image_catalogue(prefix, "one", n_real=3, n_generated=2)
    image_catalogue(prefix, "two", n_real=0, n_generated=4)
    cfg = embed_cfg(tmp_path, checkpoint)
    first = watch(cfg, str(prefix))
    assert [(Path(r.catalogue).name, r.embedded) for r in first] == [("one", 5), ("two", 4)]
    image_catalogue(prefix, "three", n_real=0, n_generated=3)
    rc = jobs.embed.main(["--watch", str(prefix), f"index.uri={tmp_path / 'index'}",
                          f"embed.checkpoint={checkpoint}", "embed.num_cpus=1"])
    assert rc == 0 and "three: embedded 3, already indexed 0" in capsys.readouterr().out
    again = watch(cfg, str(prefix))
    assert [r.embedded for r in again] == [0, 0, 0] and again[-1].total == 12


def test_s3_catalogue_and_index(ray_cluster, checkpoint, tmp_path, s3_server, s3_storage):
    folder = image_catalogue(tmp_path, "s3cat", n_real=3, n_generated=4, bad=True)
    catalogue = f"{s3_storage}/catalogues/s3cat"
    for path in folder.rglob("*"):
        if path.is_file():
            storage.write_bytes(f"{catalogue}/{path.relative_to(folder).as_posix()}", path.read_bytes())
    index = f"{s3_storage}/index"
    cfg = embed_cfg(tmp_path, checkpoint, f"index.uri={index}", f"storage.endpoint_url={s3_server.endpoint}")
    report = embed_catalogue(cfg, catalogue)
    assert (report.embedded, report.rejected, report.total) == (10, 3, 10)
    assert report.rejects_uri == f"{index}/rejects/s3cat.jsonl" and len(read_rejects(report.rejects_uri)) == 3
    assert verify(resolve(index)).ok
    table = stored(index)
    assert table["image_uri"][0].as_py().startswith(catalogue)
    again = watch(cfg, f"{s3_storage}/catalogues/")  # the s3:// prefix: one catalogue, nothing new
    assert [(r.catalogue, r.embedded, r.skipped_indexed, r.error) for r in again] == [(catalogue, 0, 10, "")]
    photo = sorted(FLOWERS.glob("*/*.jpg"))[500]
    storage.write_bytes(f"{catalogue}/gen/000.png", photo.read_bytes())  # replaced by a photo
    storage.delete(f"{catalogue}/gen/001.png")
    changed = embed_catalogue(cfg, catalogue)  # the listing's size and time say which object changed
    assert (changed.embedded, changed.changed, changed.removed, changed.read_to_compare) == (1, 1, 1, 1)
    assert changed.total == 9 and "s3cat/gen/001.png" not in stored_live(index)
    table = f"{s3_storage}/catalogues/shop.csv"  # a table on S3: relative and s3:// image locations
    storage.write_text(table, "item_id,image_uri,label,colour\n"
                              f"p1,s3cat/gen/002.png,a,red\np2,{catalogue}/gen/003.png,b,blue\n")
    shop = embed_catalogue(cfg, table)
    assert (shop.embedded, shop.total) == (2, 11)
    rows = {r["item_id"]: r for r in stored_live(index).values()}
    assert rows["p1"]["image_uri"] == f"{s3_storage}/catalogues/s3cat/gen/002.png"
    assert rows["p2"]["metadata"] == '{"colour": "blue"}' and rows["p2"]["class_name"] == "b"


def test_help_and_bad_config(capsys, tmp_path):
    job = jobs.embed
    with pytest.raises(SystemExit) as exit_help:
        job.main(["--help"])
    assert exit_help.value.code == 0 and "--watch" in capsys.readouterr().out
    assert job.main(["--catalogue", str(tmp_path), "embed.concurrency=0"]) == 2  # one line, no traceback
    assert "embed.concurrency=0 must be >= 1" in capsys.readouterr().err
    assert job.main([]) == 2 and "--catalogue" in capsys.readouterr().err
    result = subprocess.run([sys.executable, str(EMBED_JOB), "--catalogue", "x", "embed.split=val"],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 2 and "embed.split='val' is not valid" in result.stderr


def test_missing_checkpoint_and_empty_catalogue_are_clear_errors(checkpoint, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    job = jobs.embed
    assert job.main(["--catalogue", str(tmp_path / "empty"), f"embed.checkpoint={tmp_path / 'nope'}"]) == 2
    assert "not a complete PUMA checkpoint" in capsys.readouterr().err
    assert job.main(["--catalogue", str(tmp_path / "empty"), f"embed.checkpoint={checkpoint}",
                     f"index.uri={tmp_path / 'index'}"]) == 2
    assert "has no items to embed" in capsys.readouterr().err


def test_decode_stage_and_catalogue_listing_import_neither_faiss_nor_torch():
    """Ray Data decode workers unpickle read_and_decode by reference: its imports are all they load."""
    code = ("import sys, puma.inference.embedder, puma.inference.catalogue, puma.data.pipeline; "
            "print(sorted(m for m in ('faiss', 'torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.stdout.strip() == "[]"


@pytest.mark.gpu
@pytest.mark.parametrize("decode_on", ["tasks", "worker"])
def test_embed_on_gpu(ray_cluster, checkpoint, tmp_path, decode_on):
    """On a GPU actor: the same embeddings as in-process on the CPU; data.decode_on=worker decodes the
    JPEGs with nvjpeg in the actor (IDCT rounding apart, the same views: cosine >= 0.999)."""
    if not torch.cuda.is_available() or ray_cluster.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("no GPU in this Ray cluster")
    folder = image_catalogue(tmp_path, "gpu", n_real=6, n_generated=6)
    report = embed_catalogue(embed_cfg(tmp_path, checkpoint, "embed.use_gpu=true", "embed.num_gpus=0.5",
                                       f"data.decode_on={decode_on}"), str(folder))
    assert report.embedded == 12
    table = stored(str(tmp_path / "index"))
    emb = np.stack(table["embedding"].to_numpy(zero_copy_only=False))
    reference = reference_embeddings(checkpoint, table)
    if decode_on == "tasks":
        np.testing.assert_allclose(emb, reference, atol=1e-4)
    else:
        assert (emb * reference).sum(1).min() >= 0.999
