"""Round trip through a real S3 server: raw release on s3:// -> prepare -> s3:// -> Ray Data stream.

The release holds awkward images and one listed object that does not exist. Outcome, by design:
the missing object and the corrupt and truncated images are rejected once, by prepare (listed in
<prepared>/rejects/prepare.jsonl, never in a shard); the tiny image decodes but is below the job's
data.min_image_size, so the stream rejects it; the training rejects file lists all four with their
reason and stage. CMYK, palette and grayscale images are converted to RGB and arrive like all other
good images, each exactly once.
"""

from __future__ import annotations

from pathlib import Path

from puma import storage
from puma.config import load_config
from puma.data import pipeline
from puma.data.manifest import load_manifest, verify_shards
from puma.data.prepare import prepare
from puma.data.rejects import read_rejects
from puma.data.sources import SourceSpec

MEAN, STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)


def _upload(local: Path, uri: str) -> None:
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        storage.write_bytes(storage.join(uri, *path.relative_to(local).parts), path.read_bytes())


def _stream_ids(ds) -> list[str]:
    return [str(i) for b in ds.iter_batches(batch_size=8, batch_format="numpy") for i in b["item_id"]]


def test_s3_round_trip_with_bad_images_and_a_missing_object(ray_cluster, s3_storage, tmp_path, cub_tree,
                                                             bad_images, image_bytes):
    special = {name: data for name, (data, _) in bad_images.items()}
    kinds = cub_tree(tmp_path / "raw", num_classes=4, per_class=3, special=special, missing=("gone",))
    for c, i in ((0, 0), (0, 1), (1, 0), (1, 1)):  # a class-per-folder catalogue beside it
        (tmp_path / "shop" / f"c{c}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "shop" / f"c{c}" / f"{i}.jpg").write_bytes(image_bytes(seed=30 + 2 * c + i))
        kinds[f"shop/c{c}/{i}.jpg"] = "good"
    raw, out = storage.join(s3_storage, "raw"), storage.join(s3_storage, "prepared")
    _upload(tmp_path / "raw", storage.join(raw, "CUB_200_2011"))
    _upload(tmp_path / "shop", storage.join(raw, "shop"))
    specs = [SourceSpec("cub", "cub", storage.join(raw, "CUB_200_2011")),
             SourceSpec("folder", "shop", storage.join(raw, "shop"))]
    report = prepare(specs, out, shard_rows=4, log=lambda _: None)
    manifest = load_manifest(out)  # read back from S3
    assert manifest.data == report.manifest.data and verify_shards(manifest) == []
    at_prepare = {i: ("missing_file" if k == "missing" else k) for i, k in kinds.items()
                  if k in ("missing", "corrupt", "truncated")}
    assert manifest.data["totals"]["rows"] == len(kinds) - len(at_prepare) == len(kinds) - 3
    prepare_rows = read_rejects(manifest.rejects_uri)  # on S3, beside the shards
    assert {r["item_id"]: r["reason"] for r in prepare_rows} == at_prepare
    assert {r["stage"] for r in prepare_rows} == {"prepare"}
    truncated = next(r for r in prepare_rows if r["reason"] == "truncated")
    assert "truncated" in truncated["detail"] and truncated["source_path"].startswith("s3://")

    rejects_uri = storage.join(s3_storage, "run", "data_rejects.jsonl")
    cfg = load_config(None, [f"data.uri={out}", f"data.rejects_uri={rejects_uri}",
                             "model.backbone.img_size=32", "data.decode_batch_size=4"])
    label_map = pipeline.global_label_map(manifest)
    streamed = _stream_ids(pipeline.train_dataset(cfg, manifest, label_map, MEAN, STD))
    streamed += _stream_ids(pipeline.eval_dataset(cfg, manifest, "test", MEAN, STD))

    expected = {name: outcome for name, (_, outcome) in bad_images.items()}
    bad = {i: ("missing_file" if k == "missing" else expected[k]) for i, k in kinds.items()
           if k == "missing" or (k != "good" and expected[k] != "accepted")}
    good = sorted(set(kinds) - set(bad))
    assert sorted(streamed) == good  # every good item exactly once, CMYK / palette / grayscale included
    converted = (("cmyk", "jpg"), ("palette", "png"), ("grayscale", "png"))  # accepted, as RGB
    assert {i for i in good if kinds[i] != "good"} == {f"cub/images/004.Class_4/{n}.{x}"
                                                      for n, x in converted}
    rows = read_rejects(rejects_uri)
    assert {r["item_id"]: r["reason"] for r in rows} == bad  # exactly the bad items, once each
    assert {r["item_id"] for r in rows if r["stage"] == "prepare"} == set(at_prepare)  # found once
    assert [r["reason"] for r in rows if r["stage"] == "decode"] == ["tiny"] and len(rows) == len(bad) == 4

    again = prepare(specs, out, shard_rows=4, log=lambda _: None)
    assert again.written == [] and not again.manifest_changed  # idempotent on S3 too
