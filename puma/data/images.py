"""The paper's train / eval views of encoded image bytes, decoded with PIL (no Ray, no torch).

- decode: puma.data.decode (upright 8-bit RGB, or ``ImageRejected`` with a reason from
  ``puma.data.rejects.DECODE_REASONS``); its names are importable from here too.
- train view: RandomResizedCrop(img_size, scale 0.2-1, ratio 3/4-4/3, bicubic) + horizontal flip
  with probability 0.5 (torchvision's sampling algorithm).
- eval view: resize the shorter side to int(img_size * 256 / 224), center crop img_size, bicubic.
  Both views crop and resize in one resampling step (``Image.resize(box=...)``).
- normalise with the backbone's mean / std -> float32 (3, H, W).

``view_spec`` / ``eval_view_spec`` are the one place a view is planned from a config (image size,
the backbone's normalisation from timm's pretrained config, minimum image size); training-time
evaluation, the embedding job and query images all decode with the same eval view.

Large JPEGs are decoded at a reduced DCT scale (``Image.draft``) that still leaves at least the
resolution the view needs. With data.decode_on=worker a plain JPEG leaves as bytes and a crop plan
(``plan_worker_view``), decoded on the consuming worker's device (puma/data/device_views.py).
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from puma.config import ConfigError
from puma.data import schema
from puma.data.decode import (  # noqa: F401 - re-exported: their home before the split
    ALPHA_MODES,
    ImageRejected,
    check_min_size,
    decode_image,
    exif_orientation,
    rejects_bad_bytes,
    shrink_encoded,
    to_rgb,
    verify_image,
)

TRAIN_SCALE = (0.2, 1.0)
TRAIN_RATIO = (3 / 4, 4 / 3)


@dataclass(frozen=True)
class ViewSpec:
    """How to turn bytes into a model input."""

    img_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    train: bool
    min_size: int = 16
    seed: int = 0
    draft: bool = True  # JPEGs at a reduced DCT scale when the view needs far fewer pixels (data.jpeg_draft)
    crop_draft: bool = True  # training views at the DCT scale of their own crop (data.crop_draft)
    on_worker: bool = False  # plain JPEGs leave as bytes and a crop plan (data.decode_on=worker)


Normalisation = tuple[tuple[float, ...], tuple[float, ...]]  # (mean, std), one value per channel


def backbone_normalisation(cfg) -> Normalisation:
    """Mean and std of ``cfg.model.backbone`` from its timm pretrained config (no weights are loaded)."""
    import timm  # torch comes with it: only planning a view imports it, never a decode worker

    pretrained = timm.models.get_pretrained_cfg(cfg.model.backbone.name)
    if pretrained is None:
        return (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    return tuple(pretrained.mean), tuple(pretrained.std)


def view_spec(cfg, train: bool, normalisation: Normalisation | None = None,
              min_size: int | None = None) -> ViewSpec:
    """The train or eval view of ``cfg``: model.backbone.img_size, the backbone's mean / std (unless
    ``normalisation`` is given), data.min_image_size (unless ``min_size`` is), train.seed, data.jpeg_draft,
    data.crop_draft, data.decode_on."""
    mean, std = normalisation or backbone_normalisation(cfg)
    return ViewSpec(img_size=cfg.model.backbone.img_size, mean=tuple(mean), std=tuple(std), train=train,
                    min_size=cfg.data.min_image_size if min_size is None else min_size, seed=cfg.train.seed,
                    draft=cfg.data.jpeg_draft, crop_draft=cfg.data.crop_draft,
                    on_worker=cfg.data.decode_on == "worker")


def eval_view_spec(cfg, min_size: int | None = None) -> ViewSpec:
    """The eval view of ``cfg``'s model: what training-time evaluation, batch embedding and query
    images are decoded with, so one image embeds to one vector everywhere."""
    return view_spec(cfg, train=False, min_size=min_size)


def eval_resize_size(img_size: int) -> int:
    """Shorter side before the eval center crop (256 for 224)."""
    return int(img_size * 256 / 224)


def check_prepare_max_side(max_side: int, img_size: int) -> None:
    """ConfigError unless prepare's shrink (data.prepare_max_side, 0: off) keeps the eval view's size."""
    need = eval_resize_size(img_size)
    if max_side and max_side < need:
        raise ConfigError(f"data.prepare_max_side={max_side} would store images smaller than the {need} px "
                          f"the eval view of model.backbone.img_size={img_size} resizes to; use 0 (off) or "
                          f">= {need} (about {round(img_size * 2.3)} keeps the training crops' resolution)")


def random_resized_crop_box(width: int, height: int, rng: np.random.Generator,
                            scale: tuple[float, float] = TRAIN_SCALE,
                            ratio: tuple[float, float] = TRAIN_RATIO) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) as torchvision's RandomResizedCrop.get_params samples it."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            left = int(rng.integers(0, width - w + 1))
            top = int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    in_ratio = width / height  # fallback: central crop clipped to the ratio range
    w, h = (width, int(round(width / ratio[0]))) if in_ratio < ratio[0] else \
        (int(round(height * ratio[1])), height) if in_ratio > ratio[1] else (width, height)
    w, h = min(w, width), min(h, height)
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def train_view(img: Image.Image, img_size: int, rng: np.random.Generator) -> Image.Image:
    """RandomResizedCrop(img_size, scale 0.2-1, bicubic) then a horizontal flip with p = 0.5."""
    return _crop_flip(img, random_resized_crop_box(img.width, img.height, rng), img_size, rng)


def _crop_flip(img: Image.Image, box, img_size: int, rng: np.random.Generator) -> Image.Image:
    """``box`` of ``img`` resampled to img_size x img_size (bicubic), mirrored with p = 0.5 from ``rng``."""
    out = img.resize((img_size, img_size), Image.Resampling.BICUBIC, box=box)
    return out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else out


def eval_view(img: Image.Image, img_size: int) -> Image.Image:
    """Resize the shorter side to eval_resize_size(img_size), center crop img_size (one resample)."""
    box = eval_box(img.width, img.height, img_size)
    return img.resize((img_size, img_size), Image.Resampling.BICUBIC, box=box)


def normalise(img: Image.Image, mean, std) -> np.ndarray:
    """(H, W, 3) uint8 -> float32 (3, H, W), (x / 255 - mean) / std (as ``normalise_levels``)."""
    scale, shift = levels_affine(mean, std)  # (3,) each
    return normalise_levels(np.asarray(img).transpose(2, 0, 1), scale[:, None, None], shift[:, None, None])


def levels_affine(mean, std) -> tuple[np.ndarray, np.ndarray]:
    """float32 (scale, shift), shape of ``mean``, with (x / 255 - mean) / std = x * scale + shift.

    Computed in float64 from the float32 values of mean and std, so the Python floats of a ViewSpec and
    the float32 view column of a Ray batch give the same constants.
    """
    mean = np.asarray(mean, np.float32).astype(np.float64)
    std = np.asarray(std, np.float32).astype(np.float64)
    return (1.0 / (255.0 * std)).astype(np.float32), (-mean / std).astype(np.float32)


def normalise_levels(levels: np.ndarray, scale: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """8-bit levels (..., 3, H, W), any strides, uint8 or float -> a new C-contiguous float32 array
    levels * scale + shift (scale and shift broadcast, e.g. (..., 3, 1, 1)).

    Two passes over the output: the old (x / 255 - mean) / std from an (H, W, 3) float copy took four and
    a transposing copy, 0.95 ms per 224 px view on one core against 0.08 ms.
    """
    out = np.empty(levels.shape, np.float32)
    np.multiply(levels, scale, out=out)
    out += shift
    return out


def item_rng(seed: int, epoch: int, item_id: str) -> np.random.Generator:
    """The augmentation RNG of one item in one epoch: reproducible, independent of batching and retries."""
    key = int.from_bytes(hashlib.blake2b(item_id.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng([seed, epoch, key])


def make_view(data: bytes, spec: ViewSpec, rng: np.random.Generator | None = None) -> np.ndarray:
    """Encoded bytes -> normalised float32 (3, img_size, img_size); raises ImageRejected."""
    return normalise(_view_image(data, spec, rng), spec.mean, spec.std)


def make_view_uint8(data: bytes, spec: ViewSpec, rng: np.random.Generator | None = None) -> np.ndarray:
    """Encoded bytes -> the view as uint8 (3, img_size, img_size), not normalised (the Ray Data tasks' output:
    a quarter of float32's bytes through the object store; ``device_views.batch_images`` normalises)."""
    return np.ascontiguousarray(np.asarray(_view_image(data, spec, rng)).transpose(2, 0, 1))


def view_column(spec: ViewSpec, rows: int) -> np.ndarray:
    """The batch column schema.BATCH_VIEW: float32 (rows, 7) mean (3), std (3), img_size."""
    return np.tile(np.asarray((*spec.mean, *spec.std, spec.img_size), np.float32), (rows, 1))


def _view_image(data: bytes, spec: ViewSpec, rng: np.random.Generator | None) -> Image.Image:
    """The train or eval view of ``data`` as an RGB PIL image of img_size x img_size."""
    if spec.train:
        rng = rng if rng is not None else np.random.default_rng()
        if spec.draft and spec.crop_draft:
            view = _drafted_train_view(data, spec, rng)
            if view is not None:
                return view
        draft = math.ceil(spec.img_size * 2.6) if spec.draft else None  # a fixed side for every crop
        return train_view(decode_image(data, spec.min_size, draft_side=draft), spec.img_size, rng)
    draft = eval_resize_size(spec.img_size) if spec.draft else None
    return eval_view(decode_image(data, spec.min_size, draft_side=draft), spec.img_size)


def _drafted_train_view(data: bytes, spec: ViewSpec, rng: np.random.Generator) -> Image.Image | None:
    """train_view of an upright JPEG decoded at the DCT scale its own crop allows; None for other images.

    The crop box is drawn from the header's size before decoding (train_view draws the same box and flip
    from the same ``rng`` on a full-size decode), then the JPEG decodes at the largest reduction that
    leaves the box at least img_size pixels on each side (:func:`draft_for_box`). A fixed draft side
    cannot do this: every crop must keep its resolution, so 1,000 px photos decoded at full size.
    """
    with rejects_bad_bytes():
        img = Image.open(io.BytesIO(data))
        check_min_size(img.size, spec.min_size)
        if img.format != "JPEG" or exif_orientation(img) != 1:
            return None
        full = img.size
        box = random_resized_crop_box(*full, rng)
        draft_for_box(img, box, spec.img_size)
        img.load()
        img = to_rgb(img)
    sx, sy = full[0] / img.width, full[1] / img.height
    return _crop_flip(img, (box[0] / sx, box[1] / sy, box[2] / sx, box[3] / sy), spec.img_size, rng)


def draft_for_box(img: Image.Image, box: tuple[float, float, float, float], img_size: int) -> None:
    """Set an opened, not yet loaded JPEG to decode at the largest DCT reduction (1/2, 1/4, 1/8) that
    keeps ``box`` (full-size pixels) at least ``img_size`` pixels wide and high; no reduction if none does."""
    reduction = min(box[2] - box[0], box[3] - box[1]) / img_size
    if reduction >= 2:
        img.draft(None, (math.ceil(img.width / reduction), math.ceil(img.height / reduction)))


@dataclass(frozen=True)
class WorkerPlan:
    """What a decode task hands the consuming worker for one image (data.decode_on=worker).

    A plain JPEG (baseline or progressive, RGB or grayscale, upright) stays as stored: ``box`` is the
    source region (left, top, right, bottom, in pixels of the full image) to resample to img_size and
    ``flip`` whether to mirror it; the worker decodes it on its device (puma/data/device_views.py).
    Any other image (PNG, CMYK, EXIF-rotated ...) is viewed here and passed as a lossless PNG of its
    img_size view, with the identity box: the worker's resampling leaves it unchanged.
    """

    data: bytes
    box: tuple[float, float, float, float]
    flip: bool


def plan_worker_view(data: bytes, spec: ViewSpec, rng: np.random.Generator | None = None) -> WorkerPlan:
    """Read only the header of a plain JPEG and plan its view; view any other image now (ImageRejected
    as ``make_view``). The train box and flip are drawn from ``rng`` in train_view's order."""
    with rejects_bad_bytes():
        img = Image.open(io.BytesIO(data))
        plain = img.format == "JPEG" and img.mode in ("RGB", "L") and exif_orientation(img) == 1
        size = img.size
    check_min_size(size, spec.min_size)
    if not plain:
        out = io.BytesIO()
        _view_image(data, spec, rng).save(out, format="PNG", compress_level=1)
        return WorkerPlan(out.getvalue(), (0.0, 0.0, float(spec.img_size), float(spec.img_size)), False)
    if spec.train:
        rng = rng if rng is not None else np.random.default_rng()
        box = random_resized_crop_box(*size, rng)
        return WorkerPlan(data, tuple(float(v) for v in box), bool(rng.random() < 0.5))
    return WorkerPlan(data, eval_box(*size, spec.img_size), False)


def worker_columns(plans: list[WorkerPlan], spec: ViewSpec) -> dict[str, np.ndarray]:
    """The image columns of a data.decode_on=worker batch (puma/data/device_views.py) from its plans."""
    n = len(plans)
    encoded = np.empty(n, dtype=object)
    encoded[:] = [plan.data for plan in plans]
    return {schema.BATCH_ENCODED: encoded,
            schema.BATCH_CROP: np.asarray([plan.box for plan in plans], np.float32).reshape(n, 4),
            schema.BATCH_FLIP: np.asarray([plan.flip for plan in plans], bool),
            schema.BATCH_VIEW: view_column(spec, n)}  # (B, 7)


def eval_box(width: int, height: int, img_size: int) -> tuple[float, float, float, float]:
    """The source region eval_view resamples to img_size x img_size (the resize-then-center-crop box)."""
    factor = eval_resize_size(img_size) / min(width, height)
    resized_w, resized_h = int(round(width * factor)), int(round(height * factor))
    left = int(round((resized_w - img_size) / 2.0)) / factor
    top = int(round((resized_h - img_size) / 2.0)) / factor
    return left, top, left + img_size / factor, top + img_size / factor
