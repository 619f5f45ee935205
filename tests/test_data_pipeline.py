"""Decoding and views (PIL, no Ray), then the Ray Data streams on a real local Ray cluster."""

from __future__ import annotations

import io

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray.data
from PIL import Image

from puma.config import ConfigError, load_config
from puma.data import pipeline, schema
from puma.data.images import (
    ImageRejected,
    ViewSpec,
    decode_image,
    eval_resize_size,
    eval_view,
    item_rng,
    make_view,
    random_resized_crop_box,
    train_view,
)
from puma.data.prepare import prepare
from puma.data.sources import SourceSpec

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


# ----------------------------------------------------------------------------- decoding and views


@pytest.mark.parametrize("mode,fmt,kwargs", [
    ("CMYK", "JPEG", {}), ("P", "PNG", {}), ("P", "PNG", {"transparency": 0}), ("L", "PNG", {}),
    ("LA", "PNG", {}), ("RGBA", "PNG", {}), ("1", "PNG", {}), ("I;16", "PNG", {}), ("P", "GIF", {}),
])
def test_awkward_modes_become_rgb(image_bytes, mode, fmt, kwargs):
    if mode == "I;16":
        buf = io.BytesIO()
        Image.fromarray(np.full((30, 40), 40000, np.uint16)).save(buf, format="PNG")
        img = decode_image(buf.getvalue(), min_size=16)
        assert img.getpixel((0, 0)) == (156, 156, 156)  # 40000 / 65535 * 255, scaled, not clipped
    else:
        img = decode_image(image_bytes(mode, size=(40, 30), fmt=fmt, **kwargs), min_size=16)
    assert img.mode == "RGB" and img.size == (40, 30)


def test_alpha_is_composited_on_white():
    buf = io.BytesIO()
    Image.new("RGBA", (20, 20), (10, 20, 30, 0)).save(buf, format="PNG")
    assert decode_image(buf.getvalue(), 16).getpixel((5, 5)) == (255, 255, 255)


def test_bad_bytes_are_rejected_with_a_reason(bad_images):
    for name, (data, outcome) in bad_images.items():
        if outcome == "accepted":
            assert decode_image(data, 16).mode == "RGB"
            continue
        with pytest.raises(ImageRejected) as err:
            decode_image(data, 16)
        assert err.value.reason == outcome, name
    with pytest.raises(ImageRejected, match="corrupt"):
        decode_image(b"", 16)


def test_eval_view_matches_resize_then_center_crop():
    import torchvision.transforms as T

    y, x = np.mgrid[0:150, 0:200]
    smooth = np.stack([x * 255 / 200, y * 255 / 150, (x + y) * 255 / 350], -1).astype(np.uint8)
    img = Image.fromarray(smooth)  # 200 x 150, a smooth gradient
    ours = np.asarray(eval_view(img, 64), np.float32)
    resize = T.Resize(eval_resize_size(64), T.InterpolationMode.BICUBIC)
    reference = T.CenterCrop(64)(resize(img))
    assert ours.shape == (64, 64, 3)
    assert np.abs(ours - np.asarray(reference, np.float32)).mean() < 1.5  # one resample instead of two


def test_normalisation_of_a_constant_image():
    img = Image.new("RGB", (50, 30), (200, 100, 50))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    out = make_view(buf.getvalue(), ViewSpec(32, MEAN, STD, train=False))
    assert out.shape == (3, 32, 32) and out.dtype == np.float32
    want = (np.array([200, 100, 50]) / 255 - MEAN) / STD
    np.testing.assert_allclose(out.mean(axis=(1, 2)), want, atol=1e-5)


def test_random_resized_crop_matches_torchvision_statistics():
    import torch
    import torchvision.transforms as T

    rng, img = np.random.default_rng(0), Image.new("RGB", (300, 200))
    torch.manual_seed(0)
    ours, theirs = [], []
    for _ in range(3000):
        left, top, right, bottom = random_resized_crop_box(300, 200, rng)
        assert 0 <= left < right <= 300 and 0 <= top < bottom <= 200
        ours.append(((right - left) * (bottom - top) / 60000, (right - left) / (bottom - top)))
        top, left, h, w = T.RandomResizedCrop.get_params(img, scale=[0.2, 1.0], ratio=[3 / 4, 4 / 3])
        theirs.append((w * h / 60000, w / h))
    ours, theirs = np.array(ours), np.array(theirs)  # (N, 2): area fraction, aspect ratio
    assert ours[:, 0].min() >= 0.19 and 0.74 <= ours[:, 1].min() and ours[:, 1].max() <= 1.34
    np.testing.assert_allclose(ours.mean(0), theirs.mean(0), atol=0.02)
    np.testing.assert_allclose(ours.std(0), theirs.std(0), atol=0.02)
    img = Image.fromarray(np.tile(np.arange(64, dtype=np.uint8), (64, 1)))
    flips = [np.asarray(train_view(img.convert("RGB"), 16, np.random.default_rng(s)))[0, 0, 0]
             > np.asarray(train_view(img.convert("RGB"), 16, np.random.default_rng(s)))[0, -1, 0]
             for s in range(200)]
    assert 0.4 < np.mean(flips) < 0.6  # horizontal flip with p = 0.5


def test_item_rng_depends_on_seed_epoch_and_item():
    draws = {k: item_rng(*k).random() for k in [(0, 0, "a"), (0, 1, "a"), (1, 0, "a"), (0, 0, "b")]}
    assert len(set(draws.values())) == 4 and item_rng(0, 0, "a").random() == draws[(0, 0, "a")]


# ----------------------------------------------------------------------------- Ray Data streams


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """cub (6 classes x 4) and shop (4 classes x 3), prepared locally in small shards."""
    from conftest import encode_image, write_cub_tree

    root = tmp_path_factory.mktemp("pipeline")
    write_cub_tree(root / "cub", num_classes=6, per_class=4)
    for c in range(4):
        for i in range(3):
            path = root / "shop" / f"c{c}" / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(encode_image(fmt="PNG", size=(36, 36), seed=50 + 3 * c + i))
    specs = [SourceSpec("cub", "cub", str(root / "cub")), SourceSpec("folder", "shop", str(root / "shop"))]
    manifest = prepare(specs, str(root / "data"), shard_rows=7, log=lambda _: None).manifest
    columns = ["item_id", "dataset", "label", "split"]
    rows = [r for s in manifest.data["shards"]
            for r in pq.read_table(root / "data" / s["path"], columns=columns).to_pylist()]
    return root, manifest, {r["item_id"]: r for r in rows}


def _cfg(root, *overrides):
    return load_config(None, [f"data.uri={root / 'data'}", f"data.rejects_uri={root / 'rejects.jsonl'}",
                              "model.backbone.img_size=32", "data.decode_batch_size=8", "train.seed=3",
                              *overrides])


def _collect(ds) -> dict[str, list]:
    out: dict[str, list] = {k: [] for k in schema.BATCH_COLUMNS}
    for batch in ds.iter_batches(batch_size=16, batch_format="numpy"):
        for key in out:
            out[key].extend(list(batch[key]))
    return out


def test_eval_stream_has_every_test_item_once_with_dataset_labels(ray_cluster, prepared):
    root, manifest, rows = prepared
    got = _collect(pipeline.eval_dataset(_cfg(root), manifest, "test", MEAN, STD))
    test_ids = {i for i, r in rows.items() if r["split"] == "test"}
    assert sorted(got["item_id"]) == sorted(test_ids)  # each exactly once
    assert all(rows[i]["label"] == lab and rows[i]["dataset"] == d
               for i, lab, d in zip(got["item_id"], got["label"], got["dataset"], strict=True))
    assert set(got["role"]) == {"query"}
    images = np.stack(got["image"])
    assert images.shape == (len(test_ids), 3, 32, 32) and images.dtype == np.uint8  # 8-bit through Ray
    views = np.stack(got["view"])  # how the consumer normalises: the backbone's mean and std, img_size
    assert np.allclose(views, [*MEAN, *STD, 32])


def test_train_stream_global_labels_and_per_epoch_randomness(ray_cluster, prepared):
    root, manifest, rows = prepared
    cfg = _cfg(root)
    label_map = pipeline.global_label_map(manifest)
    assert len(label_map) == 3 + 2
    ds = pipeline.train_dataset(cfg, manifest, label_map, MEAN, STD)
    epochs = [_collect(ds) for _ in range(2)]
    train_ids = sorted(i for i, r in rows.items() if r["split"] == "train")
    for got in epochs:
        assert sorted(got["item_id"]) == train_ids
        assert all(label_map[(rows[i]["dataset"], rows[i]["label"])] == lab
                   for i, lab in zip(got["item_id"], got["label"], strict=True))
    assert epochs[0]["item_id"] != epochs[1]["item_id"]  # reshuffled
    first = {i: img for i, img in zip(epochs[0]["item_id"], epochs[0]["image"], strict=True)}
    second = {i: img for i, img in zip(epochs[1]["item_id"], epochs[1]["image"], strict=True)}
    assert all(not np.array_equal(first[i], second[i]) for i in train_ids)  # new crops each epoch
    again = _collect(pipeline.train_dataset(cfg, manifest, label_map, MEAN, STD))
    assert all(np.array_equal(first[i], img) for i, img in zip(again["item_id"], again["image"], strict=True))


@pytest.mark.parametrize("shuffle", ["global", "block"])
def test_a_resumed_stream_continues_the_epochs(ray_cluster, prepared, shuffle):
    """A run re-run from a checkpoint after epoch 1 (start_at_epoch(stream, 1)) gets epoch 2's order and
    crops, not epoch 1's again: the stream of an uninterrupted run's second epoch, row for row."""
    root, manifest, _ = prepared
    cfg = _cfg(root, f"data.shuffle={shuffle}")
    label_map = pipeline.global_label_map(manifest)
    ctx = ray.data.DataContext.get_current()
    global_index = ctx._execution_idx
    before, ctx.execution_options.preserve_order = ctx.execution_options.preserve_order, True
    try:
        def stream():
            return pipeline.train_dataset(cfg, manifest, label_map, MEAN, STD)

        straight = stream()
        epochs = [_collect(straight) for _ in range(2)]
        resumed = _collect(pipeline.start_at_epoch(stream(), 1))
        fresh = _collect(stream())
        # Ray Train's path: the dataset pickled to streaming_split's coordinator keeps its first epoch
        (shard,) = pipeline.start_at_epoch(stream(), 1).streaming_split(1, equal=True)
        split = {i: img for b in shard.iter_batches(batch_size=8, batch_format="numpy")
                 for i, img in zip(b["item_id"], b["image"], strict=True)}
    finally:
        ctx.execution_options.preserve_order = before
    second = dict(zip(epochs[1]["item_id"], epochs[1]["image"], strict=True))
    assert split.keys() == second.keys() and all(np.array_equal(split[i], second[i]) for i in second)
    assert epochs[0]["item_id"] != epochs[1]["item_id"]
    assert resumed["item_id"] == epochs[1]["item_id"]  # epoch 2's order ...
    assert all(np.array_equal(a, b)  # ... and its crops
               for a, b in zip(resumed["image"], epochs[1]["image"], strict=True))
    assert fresh["item_id"] == epochs[0]["item_id"]  # and only this stream: a new one starts at epoch 1
    assert ctx._execution_idx == global_index  # the process's own context is left alone


def test_block_shuffle_reorders_shards_and_rows_every_epoch_and_repeats_with_the_seed(ray_cluster, prepared):
    """data.shuffle=block: no all-to-all; every epoch a new order of the shards and of each block's rows
    (the read task permutes them), each training row once, and the same seed repeats the epochs."""
    root, manifest, rows = prepared
    cfg = _cfg(root, "data.shuffle=block")
    label_map = pipeline.global_label_map(manifest)
    ctx = ray.data.DataContext.get_current()
    before, ctx.execution_options.preserve_order = ctx.execution_options.preserve_order, True
    try:
        ds = pipeline.train_dataset(cfg, manifest, label_map, MEAN, STD)
        assert "RandomShuffle" not in str(ds) and "Randomize" not in str(ds)  # no all-to-all
        epochs = [_collect(ds)["item_id"] for _ in range(3)]
        rerun = pipeline.train_dataset(cfg, manifest, label_map, MEAN, STD)
        again = [_collect(rerun)["item_id"] for _ in range(2)]
    finally:
        ctx.execution_options.preserve_order = before
    stored = [i for uri in manifest.shard_uris("train")  # the shards' own (hash) order
              for i in pq.read_table(uri, columns=["item_id"])["item_id"].to_pylist()
              if rows[i]["split"] == "train"]
    for got in epochs:
        assert sorted(got) == sorted(stored)  # every training row, once
        assert got != stored
    assert epochs[0] != epochs[1] != epochs[2]  # a new order every epoch
    assert again == epochs[:2]  # the same seed repeats them


def test_block_permutation_depends_on_seed_epoch_and_block():
    import pyarrow as pa

    table = pa.table({"item_id": [f"i{k}" for k in range(50)]})
    other = pa.table({"item_id": [f"j{k}" for k in range(50)]})
    base = pipeline._block_permutation(table, 0)
    assert sorted(base) == list(range(50))
    assert np.array_equal(base, pipeline._block_permutation(table, 0))
    assert not np.array_equal(base, pipeline._block_permutation(table, 1))
    assert not np.array_equal(base, pipeline._block_permutation(other, 0))


def test_reads_have_two_blocks_per_decode_slot_and_per_shard(ray_cluster, prepared):
    """Each block is a decode task's input, and Ray's shuffle makes an object per (input block, output block)
    pair and keeps the input's block count: reads are split into two blocks per decode task the cluster runs
    at once (at least two per shard), not into Ray's ~1 MB blocks (49 x 49 shuffle objects for 500 rows of
    1,000 px photos)."""
    root, manifest, rows = prepared
    shards = len(manifest.shard_uris("train"))
    assert shards >= 2
    for decode_cpus, want in ((2.0, max(2 * shards, 4)), (0.25, max(2 * shards, 32))):  # 4 logical CPUs here
        cfg = _cfg(root, f"data.num_decode_cpus={decode_cpus}")
        assert pipeline.read_blocks(cfg, shards) == want
    shuffled = pipeline.read_rows(cfg, manifest, "train").random_shuffle(seed=1).materialize()
    train_rows = sum(1 for r in rows.values() if r["split"] == "train")
    assert shuffled.count() == train_rows
    assert shuffled.num_blocks() == min(want, train_rows)  # no empty blocks: a block holds a row at least


def _images_by_item(ds, epochs: int = 1) -> list[dict[str, np.ndarray]]:
    """Per epoch, item id -> its model input (batch_images on the CPU, whichever side decoded)."""
    from puma.data.device_views import batch_images

    out = []
    for _ in range(epochs):  # one execution of the stream each
        out.append({i: img for b in ds.iter_batches(batch_size=8, batch_format="numpy")
                    for i, img in zip(b["item_id"], batch_images(b, "cpu").numpy(), strict=True)})
    return out


def test_decoding_on_the_worker_yields_the_tasks_views_in_both_streams(ray_cluster, prepared):
    """data.decode_on=worker: the same items, labels, crops and flips per epoch, decoded by the consumer
    (JPEGs of cub) or by the tasks (PNGs of shop), as data.decode_on=tasks without draft decoding."""
    root, manifest, _ = prepared
    tasks, worker = _cfg(root, "data.jpeg_draft=false"), _cfg(root, "data.decode_on=worker")
    label_map = pipeline.global_label_map(manifest)
    for make in (lambda c: pipeline.eval_dataset(c, manifest, "test", MEAN, STD),
                 lambda c: pipeline.train_dataset(c, manifest, label_map, MEAN, STD)):
        batch = next(iter(make(worker).iter_batches(batch_size=64, batch_format="numpy")))
        assert "image" not in batch  # only encoded bytes cross the object store
        assert {bytes(e)[:4] for e in batch["encoded"]} == {b"\xff\xd8\xff\xe0", b"\x89PNG"}  # cub, shop
        want, got = _images_by_item(make(tasks), 2), _images_by_item(make(worker), 2)
        assert [w.keys() for w in want] == [g.keys() for g in got]
        for w, g in zip(want, got, strict=True):
            assert max(np.abs(w[i] - g[i]).max() for i in w) * max(STD) * 255 <= 2.5


def test_streaming_split_reseeds_each_epoch(ray_cluster, prepared):
    """The path Ray Train uses (streaming_split): each epoch is a new execution, with new crops."""
    root, manifest, _ = prepared
    cfg = _cfg(root, "data.shuffle=local")
    ds = pipeline.train_dataset(cfg, manifest, pipeline.global_label_map(manifest), MEAN, STD)
    (shard,) = ds.streaming_split(1, equal=True)
    epochs = []
    for epoch in range(2):
        batches = shard.iter_batches(batch_size=8, batch_format="numpy", **pipeline.iter_options(cfg, epoch))
        epochs.append({i: img for b in batches for i, img in zip(b["item_id"], b["image"], strict=True)})
    assert epochs[0].keys() == epochs[1].keys()
    assert all(not np.array_equal(epochs[0][i], epochs[1][i]) for i in epochs[0])


def test_validation_classes_are_held_out_of_training(ray_cluster, prepared):
    root, manifest, rows = prepared
    cfg = _cfg(root, "data.val_fraction=0.34")
    label_map = pipeline.global_label_map(manifest, cfg.data.val_fraction)
    train = _collect(pipeline.train_dataset(cfg, manifest, label_map, MEAN, STD))
    val = _collect(pipeline.eval_dataset(cfg, manifest, "val", MEAN, STD))
    val_classes = {(d, int(lab)) for d, lab in zip(val["dataset"], val["label"], strict=True)}
    assert val_classes == {("cub", 2), ("shop", 1)}  # the last training class of each dataset
    assert set(val["role"]) == {"query"} and len(val["item_id"]) == 4 + 3
    assert not {(rows[i]["dataset"], rows[i]["label"]) for i in train["item_id"]} & val_classes
    assert len(train["item_id"]) + len(val["item_id"]) == sum(r["split"] == "train" for r in rows.values())


def test_few_shot_keeps_k_seeded_images_per_class_the_same_on_every_run(ray_cluster, prepared):
    """data.shots_per_class: k training images per class (all of a smaller class), chosen by the seed
    alone; the training stream, the training images in the eval view and the counts agree."""
    from puma.data.fewshot import select_shots

    root, manifest, rows = prepared
    label_map = pipeline.global_label_map(manifest)
    per_class: dict = {}
    for i, r in rows.items():
        if r["split"] == "train":
            per_class.setdefault((r["dataset"], r["label"]), set()).add(i)
    for k in (1, 2, 3):
        cfg = _cfg(root, f"data.shots_per_class={k}")
        got = _collect(pipeline.train_dataset(cfg, manifest, label_map, MEAN, STD))
        again = _collect(pipeline.eval_dataset(cfg, manifest, "train", MEAN, STD))
        assert sorted(got["item_id"]) == sorted(again["item_id"])  # one selection, every stream
        chosen = set(got["item_id"])
        for images in per_class.values():  # cub classes hold 2 training images, shop classes 1 or 2
            assert len(chosen & images) == min(k, len(images))
        assert pipeline.count_rows(cfg, manifest, "train") == len(chosen)
        assert chosen == select_shots(manifest, ["cub", "shop"], k, 0)  # stable: the seed alone decides
    one = select_shots(manifest, ["cub", "shop"], 1, 0)
    assert one <= select_shots(manifest, ["cub", "shop"], 2, 0)  # growing k keeps the smaller draw
    assert one != select_shots(manifest, ["cub", "shop"], 1, 7)  # another seed, other images
    with pytest.raises(ConfigError, match="data.shots_per_class=-1 must be >= 0"):
        _cfg(root, "data.shots_per_class=-1")


def test_dataset_selection(ray_cluster, prepared):
    root, manifest, _ = prepared
    cfg = _cfg(root, "data.datasets=[shop]", "data.shuffle=none")
    label_map = pipeline.global_label_map(manifest, datasets=cfg.data.datasets)
    got = _collect(pipeline.train_dataset(cfg, manifest, label_map, MEAN, STD))
    assert set(got["dataset"]) == {"shop"} and sorted(set(got["label"])) == [0, 1]
    with pytest.raises(ValueError, match=r"label map lacks 1 training class.*\('shop', 1\)"):
        pipeline.train_dataset(cfg, manifest, {("shop", 0): 0}, MEAN, STD)  # checked before streaming


def test_reject_log_keeps_one_row_per_item_under_retries(ray_cluster, prepared):
    """A retried decode task sends the same rejects again: the file still lists each item once."""
    from puma.data.rejects import read_rejects

    root, manifest, _ = prepared
    cfg = _cfg(root, f"data.rejects_uri={root / 'retry-rejects.jsonl'}")
    log = pipeline.reject_log(cfg, manifest)
    rows = [{"item_id": "cub/x.jpg", "dataset": "cub", "reason": "corrupt", "stage": "decode"},
            {"item_id": "cub/y.jpg", "dataset": "cub", "reason": "tiny", "stage": "decode"}]
    assert ray_cluster.get(log.record.remote(rows)) == 2
    assert ray_cluster.get(log.record.remote(rows[::-1])) == 0  # the retry's duplicates
    assert pipeline.reject_log(cfg, manifest)._actor_id == log._actor_id  # one actor per rejects file
    written = read_rejects(str(root / "retry-rejects.jsonl"))
    assert [r["item_id"] for r in written] == ["cub/x.jpg", "cub/y.jpg"]


def test_reject_log_outlives_the_stream_that_created_it(ray_cluster, prepared):
    """A finished stream's Dataset is dropped before the next stream starts: its rejects stay listed
    (the actor died with the only handle before, and the next stream met a dead or empty actor)."""
    import gc
    import time

    from puma.data.rejects import read_rejects

    root, manifest, _ = prepared
    cfg = _cfg(root, f"data.rejects_uri={root / 'dropped-rejects.jsonl'}")
    log = pipeline.reject_log(cfg, manifest)
    actor_id = log._actor_id
    row = {"item_id": "cub/z.jpg", "dataset": "cub", "reason": "tiny", "stage": "decode"}
    assert ray_cluster.get(log.record.remote([row])) == 1
    del log
    gc.collect()
    time.sleep(2.0)  # time for Ray to destroy an actor whose handles are all gone
    again = pipeline.reject_log(cfg, manifest)
    assert again._actor_id == actor_id
    assert "cub/z.jpg" in {r["item_id"] for r in ray_cluster.get(again.rows.remote())}
    assert "cub/z.jpg" in {r["item_id"] for r in read_rejects(str(root / "dropped-rejects.jsonl"))}


def test_a_shard_with_the_wrong_schema_is_a_clear_error(ray_cluster, prepared, tmp_path):
    import json
    import shutil

    import pyarrow as pa

    from puma.data.manifest import load_manifest

    root, manifest, _ = prepared
    copy = tmp_path / "data"
    shutil.copytree(root / "data", copy)
    first = next(s for s in manifest.data["shards"] if s["split"] == "test")
    pq.write_table(pa.table({"item_id": ["x"], "label": [1]}), copy / first["path"])
    with pytest.raises(schema.SchemaError, match=r"missing \['class_name', 'dataset'"):
        pipeline.eval_dataset(_cfg(tmp_path), load_manifest(str(copy)), "test", MEAN, STD)
    assert json.loads((copy / "manifest.json").read_text())["schema_version"] == schema.SCHEMA_VERSION
