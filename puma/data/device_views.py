"""A decoded batch as the model's input tensor on the consumer's device (torch, no Ray).

With ``data.decode_on: tasks`` (the default) the Ray Data tasks have already decoded, cropped and
normalised every image: ``batch_images`` only moves ``image`` (float32) to the device.

With ``data.decode_on: worker`` the tasks read only the header of a plain JPEG (upright, RGB or
grayscale) and plan its view (``images.plan_worker_view``); the consumer decodes it here, on its own
device: nvjpeg through torchvision's batched ``decode_jpeg`` on a GPU, libjpeg-turbo on a CPU. It then
resamples the planned box to img_size with PIL's own filter weights (``resample_boxes``: the same
pixels as the tasks' PIL views, up to the JPEG decoders' rounding), mirrors where planned and
normalises. Images the
tasks decoded themselves (PNG, CMYK, EXIF-rotated JPEGs ...) arrive as uint8 views. Prepare verified
that every stored image decodes, so a JPEG that the device's decoder refuses is decoded with PIL on
the worker's CPU instead (counted in ``FALLBACKS``), never dropped.

Batch columns of the worker mode (numpy, B rows; schema.BATCH_*):
    image      uint8 (B, 3, S, S)   views made by the tasks (zeros on rows sent as JPEG)
    jpeg       object (B,) bytes    the encoded JPEG, b"" on rows the tasks decoded
    crop       float32 (B, 4)       source box (left, top, right, bottom) of each JPEG, in pixels
    flip       bool (B,)            mirror the JPEG's view
    normalise  float32 (B, 6)       the backbone's mean (3) then std (3)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import torch

from puma.data import schema
from puma.data.images import decode_image

FALLBACKS = {"jpeg_on_cpu": 0}  # JPEGs the device's decoder refused, decoded with PIL instead


def batch_images(batch: Mapping[str, np.ndarray], device: torch.device | str) -> torch.Tensor:
    """The batch's normalised float32 images (B, 3, S, S) on ``device``, whichever side decoded them."""
    device = torch.device(device)
    if schema.BATCH_JPEG not in batch:
        return torch.as_tensor(np.asarray(batch[schema.BATCH_IMAGE]), device=device)  # (B, 3, S, S)
    views = torch.as_tensor(np.asarray(batch[schema.BATCH_IMAGE]), device=device)  # (B, 3, S, S) uint8
    views = views.to(torch.float32)
    jpegs = [bytes(b) for b in batch[schema.BATCH_JPEG]]
    rows = [i for i, data in enumerate(jpegs) if data]
    if rows:
        boxes = np.asarray(batch[schema.BATCH_CROP], np.float64)[rows]  # (J, 4)
        flips = np.asarray(batch[schema.BATCH_FLIP], bool)[rows]
        decoded = decode_jpegs([jpegs[i] for i in rows], device)
        index = torch.as_tensor(rows, device=device)
        views.index_copy_(0, index, resample_boxes(decoded, boxes, views.shape[-1], flips))
    norm = torch.as_tensor(np.asarray(batch[schema.BATCH_NORMALISE], np.float32), device=device)  # (B, 6)
    mean, std = norm[:, :3, None, None], norm[:, 3:, None, None]
    return (views / 255.0 - mean) / std


def decode_jpegs(datas: list[bytes], device: torch.device) -> list[torch.Tensor]:
    """RGB uint8 (3, H, W) tensors on ``device``: one batched decode_jpeg call, image by image if the
    batch fails, and PIL on the CPU for any image the device's decoder refuses."""
    from torchvision.io import ImageReadMode, decode_jpeg

    encoded = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchvision >= 0.29 deprecates its decoders in favour of TorchCodec
        try:
            return list(decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device))
        except RuntimeError:
            out = []
            for data, tensor in zip(datas, encoded, strict=True):
                try:
                    out.append(decode_jpeg(tensor, mode=ImageReadMode.RGB, device=device))
                except RuntimeError:
                    FALLBACKS["jpeg_on_cpu"] += 1
                    array = np.asarray(decode_image(data, min_size=1)).transpose(2, 0, 1)  # (3, H, W)
                    out.append(torch.from_numpy(np.ascontiguousarray(array)).to(device))
            return out


def resample_boxes(images: list[torch.Tensor], boxes: np.ndarray, size: int, flips: np.ndarray,
                   chunk: int = 32) -> torch.Tensor:
    """Each image's ``box`` (left, top, right, bottom) resampled to float (3, size, size) in 8-bit levels,
    as PIL's ``Image.resize(size, BICUBIC, box=box)`` computes it: its filter weights (bicubic, a = -0.5,
    widened by the downscale factor, reading the pixels around the box), horizontal pass first, rounded
    to 8 bits after each pass. Batched: the regions, zero-padded to the largest, go through two batched
    matrix products per ``chunk`` images (the padding has weight 0). Returns (N, 3, size, size)."""
    out = []
    for start in range(0, len(images), chunk):
        part = slice(start, start + chunk)
        out.append(_resample_chunk(images[part], boxes[part], size, flips[part]))
    return torch.cat(out)


def _resample_chunk(images: list[torch.Tensor], boxes: np.ndarray, size: int,
                    flips: np.ndarray) -> torch.Tensor:
    device = images[0].device
    xs = [_pil_band(img.shape[-1], box[0], box[2], size) for img, box in zip(images, boxes, strict=True)]
    ys = [_pil_band(img.shape[-2], box[1], box[3], size) for img, box in zip(images, boxes, strict=True)]
    weights_x, weights_y = _dense(xs, size, device), _dense(ys, size, device)  # (N, S, nx), (N, S, ny)
    regions = torch.zeros((len(images), 3, weights_y.shape[2], weights_x.shape[2]), device=device)
    for i, (img, (x0, nx, _, _), (y0, ny, _, _)) in enumerate(zip(images, xs, ys, strict=True)):
        regions[i, :, :ny, :nx] = img[:, y0:y0 + ny, x0:x0 + nx]  # uint8 -> float32
    rows = (regions @ weights_x.transpose(1, 2)[:, None]).round_().clamp_(0, 255)  # (N, 3, ny, S)
    views = (weights_y[:, None] @ rows).round_().clamp_(0, 255)  # (N, 3, S, S)
    flip = torch.as_tensor(flips, device=device)
    return torch.where(flip[:, None, None, None], views.flip(-1), views)


Band = tuple[int, int, np.ndarray, np.ndarray]  # first pixel, pixels spanned, index (out, k), weights


def _pil_band(in_size: int, start: float, stop: float, out_size: int) -> Band:
    """PIL's precompute_coeffs for one axis as a band: (first input pixel, pixels spanned, index (out, k)
    relative to the first pixel, normalised weights (out, k), 0 outside each output pixel's support)."""
    scale = (stop - start) / out_size
    filter_scale = max(scale, 1.0)
    support = 2.0 * filter_scale  # bicubic's support, widened when downscaling
    centers = start + (np.arange(out_size) + 0.5) * scale
    lo = np.clip(np.trunc(centers - support + 0.5), 0, in_size).astype(np.int64)
    hi = np.clip(np.trunc(centers + support + 0.5), 0, in_size).astype(np.int64)
    taps = np.arange(int((hi - lo).max()))  # (k,)
    pixels = lo[:, None] + taps[None, :]  # (out, k)
    x = np.abs((pixels - centers[:, None] + 0.5) / filter_scale)
    a = -0.5
    weights = np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                       np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))
    weights = np.where(pixels < hi[:, None], weights, 0.0)
    weights /= np.maximum(weights.sum(1, keepdims=True), 1e-12)
    first = int(lo.min())
    return first, int(hi.max()) - first, np.minimum(pixels, hi[:, None] - 1) - first, weights


def _dense(bands: list[Band], size: int, device) -> torch.Tensor:
    """(N, size, widest band) weight matrices from bands, built on ``device`` with one scatter."""
    taps = max(b[2].shape[1] for b in bands)
    index = np.zeros((len(bands), size, taps), np.int64)
    weight = np.zeros((len(bands), size, taps), np.float32)
    for i, (_, _, idx, w) in enumerate(bands):
        index[i, :, :idx.shape[1]], weight[i, :, :w.shape[1]] = idx, w
    dense = torch.zeros((len(bands), size, max(b[1] for b in bands)), device=device)
    return dense.scatter_add_(2, torch.from_numpy(index).to(device), torch.from_numpy(weight).to(device))
