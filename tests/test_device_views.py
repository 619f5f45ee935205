"""data.decode_on=worker: the tasks plan plain JPEGs' views from their headers, the consuming worker
decodes and resamples them on its device (puma/data/device_views.py). On a CPU (torchvision's
libjpeg-turbo) the views equal the tasks' PIL views; on a GPU (nvjpeg, ``gpu`` marker) they differ
only by the IDCT's rounding."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import encode_image
from PIL import Image

from puma.config import ConfigError, load_config
from puma.data import device_views, schema
from puma.data.device_views import batch_images
from puma.data.images import (
    ImageRejected,
    ViewSpec,
    item_rng,
    make_view,
    normalise,
    plan_worker_view,
    worker_columns,
)

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "cub200-subset" / "CUB_200_2011" / "images"


def _photos(count: int = 24) -> list[bytes]:
    files = sorted(SAMPLE.rglob("*.jpg"))[:count]
    assert len(files) == count, f"the CUB sample photos are missing under {SAMPLE}"
    return [f.read_bytes() for f in files]


def _large(datas: list[bytes], side: int = 1000) -> list[bytes]:
    """The photos resized up to a longer side of ``side`` px (JPEG q90), as SOP or NABirds photos are."""
    out = []
    for data in datas:
        img = Image.open(io.BytesIO(data)).convert("RGB")
        factor = side / max(img.size)
        buf = io.BytesIO()
        img.resize((round(img.width * factor), round(img.height * factor)), Image.Resampling.BICUBIC) \
            .save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def _levels(datas: list[bytes], train: bool, device: str, size: int = 224) -> np.ndarray:
    """|worker view - PIL view| in 8-bit levels, per row: (N, 3, S, S)."""
    spec = ViewSpec(size, MEAN, STD, train, draft=False)
    worker = ViewSpec(size, MEAN, STD, train, on_worker=True)
    rng = (lambda i: item_rng(3, 1, f"item{i}")) if train else (lambda i: None)
    reference = np.stack([make_view(d, spec, rng(i)) for i, d in enumerate(datas)])
    batch = worker_columns([plan_worker_view(d, worker, rng(i)) for i, d in enumerate(datas)], worker)
    got = batch_images(batch, device)
    assert got.device.type == torch.device(device).type and got.dtype == torch.float32
    return np.abs(got.cpu().numpy() - reference) * np.asarray(STD, np.float32)[:, None, None] * 255


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_worker_views_equal_the_tasks_pil_views_on_the_cpu(train):
    levels = _levels(_photos(), train, "cpu")
    assert levels.max() <= 2.5, "PIL's fixed-point weights differ from ours by at most a level or two"
    assert levels.mean() < 0.01


def test_only_plain_jpegs_are_left_to_the_worker_and_the_rest_match_too():
    buf, exif = io.BytesIO(), Image.Exif()
    exif[0x0112] = 6  # stored sideways
    Image.open(io.BytesIO(encode_image(size=(60, 40), seed=4))).save(buf, format="JPEG", exif=exif.tobytes())
    images = {"rgb": encode_image(size=(60, 40), seed=1), "grayscale": encode_image("L", (60, 40), seed=2),
              "cmyk": encode_image("CMYK", (60, 40), seed=3), "png": encode_image(size=(60, 40), fmt="PNG"),
              "rotated": buf.getvalue()}
    worker = ViewSpec(32, MEAN, STD, False, on_worker=True)
    plans = {k: plan_worker_view(v, worker) for k, v in images.items()}
    assert {k for k, p in plans.items() if p.data == images[k]} == {"rgb", "grayscale"}  # as stored
    viewed = [Image.open(io.BytesIO(p.data)) for k, p in plans.items() if k not in ("rgb", "grayscale")]
    assert all(v.format == "PNG" and v.size == (32, 32) for v in viewed)  # the tasks' views, lossless
    levels = _levels(list(images.values()), False, "cpu", size=32)
    assert levels.max() <= 2.5


def test_bad_images_are_rejected_by_the_task_as_before(bad_images):
    worker = ViewSpec(32, MEAN, STD, False, on_worker=True)
    for name in ("corrupt", "tiny"):
        with pytest.raises(ImageRejected) as err:
            plan_worker_view(bad_images[name][0], worker)
        assert err.value.reason == bad_images[name][1]


def test_a_jpeg_the_device_decoder_refuses_is_decoded_with_pil_instead(monkeypatch):
    import torchvision.io

    datas = _photos(4)
    real = torchvision.io.decode_jpeg

    def refuse_second(data, *args, **kwargs):  # failure injection: the batch call and one image fail
        if isinstance(data, list) or data.numel() == len(datas[1]):
            raise RuntimeError("nvjpeg: unsupported stream")
        return real(data, *args, **kwargs)

    monkeypatch.setattr(torchvision.io, "decode_jpeg", refuse_second)
    before = device_views.FALLBACKS["jpeg_on_cpu"]
    assert _levels(datas, False, "cpu").max() <= 2.5
    assert device_views.FALLBACKS["jpeg_on_cpu"] == before + 1


def test_the_task_mode_batch_passes_through_unchanged():
    images = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    got = batch_images({schema.BATCH_IMAGE: images, schema.ITEM_ID: np.array(["a", "b"])}, "cpu")
    np.testing.assert_array_equal(got.numpy(), images)


def test_eight_bit_views_are_normalised_per_row_and_left_untouched():
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (3, 3, 8, 8), dtype=np.uint8)
    view = np.array([[0.485, 0.456, 0.406, 0.229, 0.224, 0.225, 8], [0.5] * 6 + [8],
                     [0.1, 0.2, 0.3, 1, 2, 3, 8]], np.float32)  # each row its own mean and std
    kept = images.copy()
    got = batch_images({schema.BATCH_IMAGE: images, schema.BATCH_VIEW: view}, "cpu")
    assert got.dtype == torch.float32 and got.shape == images.shape
    for row, levels in enumerate(images):  # bit for bit the DataLoader-style float32 view (images.normalise)
        want = normalise(levels.transpose(1, 2, 0), view[row, :3], view[row, 3:6])
        np.testing.assert_array_equal(got[row].numpy(), want)
    np.testing.assert_array_equal(images, kept)  # the batch's own array is not written to


def test_normalise_is_the_reference_formula_in_a_fresh_contiguous_array():
    from PIL import Image

    rng = np.random.default_rng(2)
    levels = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)  # (H, W, 3)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    got = normalise(Image.fromarray(levels), mean, std)
    want = (levels.astype(np.float64) / 255 - np.asarray(mean)) / np.asarray(std)
    assert got.dtype == np.float32 and got.shape == (3, 5, 7) and got.flags.c_contiguous
    np.testing.assert_allclose(got, want.transpose(2, 0, 1), rtol=0, atol=2e-6)


def test_prefetched_keeps_the_order_raises_the_threads_error_and_stops_early():
    import threading
    import time

    from puma.data.device_views import prefetched

    def batches(n, fail_at=None):
        for i in range(n):
            if i == fail_at:
                raise OSError("shard unreadable")
            yield {schema.BATCH_IMAGE: np.full((1, 3, 2, 2), i, np.float32)}

    got = [int(images[0, 0, 0, 0]) for _, images in prefetched(batches(7), "cpu", depth=2)]
    assert got == list(range(7))
    with pytest.raises(OSError, match="shard unreadable"):
        list(prefetched(batches(5, fail_at=3), "cpu"))
    pairs = prefetched(batches(1000), "cpu", depth=2)
    next(pairs)
    pairs.close()  # leaving the loop early
    time.sleep(0.3)
    assert not any(t.name == "puma-batch-images" for t in threading.enumerate())


def test_decode_on_is_checked():
    with pytest.raises(ConfigError, match="data.decode_on"):
        load_config(None, ["data.decode_on=gpu"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_nvjpeg_views_match_the_pil_views(train):
    """nvjpeg's pixels differ from libjpeg-turbo's (measured on an H100: mean 0.48 and p99 5 levels on
    the CUB photos, 0.03 and 1 level on 1,000 px photos, where downscaling averages the differences out),
    so the bound is on levels, not equality; test_embed_job bounds the embeddings (cosine >= 0.999)."""
    datas = _photos()
    for photos, (mean, p99) in ((datas, (0.75, 6.0)), (_large(datas), (0.1, 2.0))):
        levels = _levels(photos, train, "cuda")
        assert levels.mean() < mean and np.percentile(levels, 99) <= p99


@pytest.mark.budget(200)  # two tiny fits, decoding on the driver's tasks and on the worker (59-143 s)
def test_training_with_decoding_on_the_worker_follows_the_tasks_run(ray_cluster, cub_tree, tmp_path):
    """jobs/train.py's loop with data.decode_on=worker (the JPEGs decoded in the Train worker, the next
    batches prefetched in a thread) takes the steps of a data.decode_on=tasks run without draft
    decoding: the same items, crops and flips, pixels within a level or two, so the same losses."""
    import yaml
    from tiny import TINY_BACKBONE

    from puma.checkpoint import read_checkpoint
    from puma.data.prepare import prepare
    from puma.data.sources import SourceSpec
    from puma.train.driver import run_training

    cub_tree(tmp_path / "cub", num_classes=4, per_class=6)
    data = str(tmp_path / "prepared")
    prepare([SourceSpec("cub", "cub", str(tmp_path / "cub"))], data, log=lambda _: None)
    histories = {}
    for name, data_cfg in (("tasks", {"jpeg_draft": False}), ("worker", {"decode_on": "worker"})):
        cfg_file = tmp_path / f"{name}.yaml"
        cfg_file.write_text(yaml.safe_dump({
            "model": {"backbone": dict(TINY_BACKBONE), "adapter": {"rank": 8},
                      "prompt_pool": {"pool_size": 4, "length": 2}, "head": {"embed_dim": 16}},
            "data": {"uri": data, "preset": "", "decode_batch_size": 8,
                     "deterministic": True, **data_cfg},  # rows in the same order in both runs
            "train": {"epochs": 2, "batch_size": 8, "cpus_per_worker": 0.5, "eval_every": 2,
                      "eval_before": False, "storage_path": str(tmp_path / "runs"), "run_name": name}}))
        outcome = run_training(load_config(cfg_file))
        ckpt = read_checkpoint(outcome.last_checkpoint)
        assert ckpt.config.data.decode_on == name  # the config saved with the run
        histories[name] = ckpt.meta["run_state"]["history"]
    losses = {k: [h["train/loss"] for h in v] for k, v in histories.items()}
    assert [h["train/steps"] for h in histories["worker"]] == [1, 1]  # 12 training images, batch 8
    np.testing.assert_allclose(losses["worker"], losses["tasks"], rtol=1e-3)
    recall = {k: {m: v for m, v in h[-1].items() if m.endswith("/r@1")} for k, h in histories.items()}
    assert recall["worker"] and recall["worker"].keys() == recall["tasks"].keys()  # evaluated in both modes
    np.testing.assert_allclose([recall["worker"][m] for m in sorted(recall["tasks"])],
                               [recall["tasks"][m] for m in sorted(recall["tasks"])], atol=0.05)
