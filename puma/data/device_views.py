"""A decoded batch as the model's input tensor on the consumer's device (torch, no Ray).

With ``data.decode_on: tasks`` (the default) the Ray Data tasks have already decoded, cropped and
normalised every image: ``batch_images`` only moves ``image`` (float32) to the device.

With ``data.decode_on: worker`` the tasks read only the header of a plain JPEG (upright, RGB or
grayscale) and plan its view (``images.plan_worker_view``); the consumer decodes it here, on its own
device: nvjpeg through torchvision's batched ``decode_jpeg`` on a GPU, libjpeg-turbo on a CPU. It then
resamples the planned box to img_size with PIL's own filter weights (``resample_box``: the same
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
        size = views.shape[-1]
        boxes = np.asarray(batch[schema.BATCH_CROP], np.float64)
        flips = np.asarray(batch[schema.BATCH_FLIP], bool)
        decoded = decode_jpegs([jpegs[i] for i in rows], device)
        for i, img in zip(rows, decoded, strict=True):
            views[i] = resample_box(img, tuple(boxes[i]), size, bool(flips[i]))
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


def resample_box(img: torch.Tensor, box: tuple[float, ...], size: int, flip: bool) -> torch.Tensor:
    """The region ``box`` (left, top, right, bottom) of a uint8 (3, H, W) image resampled to float
    (3, size, size) in 8-bit levels, as PIL's ``Image.resize(size, BICUBIC, box=box)`` computes it:
    its filter weights (bicubic, a = -0.5, widened by the downscale factor, reading pixels around the
    box), horizontal pass first, rounded to 8 bits after each pass. Two small matrix products."""
    height, width = img.shape[-2:]
    left, top, right, bottom = box
    x0, weights_x = _pil_weights(width, left, right, size, img.device)  # (size, nx)
    y0, weights_y = _pil_weights(height, top, bottom, size, img.device)  # (size, ny)
    region = img[:, y0:y0 + weights_y.shape[1], x0:x0 + weights_x.shape[1]].float()  # (3, ny, nx)
    rows = (region @ weights_x.T).round_().clamp_(0, 255)  # (3, ny, size)
    view = (weights_y @ rows).round_().clamp_(0, 255)  # (3, size, size)
    return view.flip(-1) if flip else view


def _bicubic(x: torch.Tensor, a: float = -0.5) -> torch.Tensor:
    x = x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def _pil_weights(in_size: int, start: float, stop: float, out_size: int,
                 device: torch.device) -> tuple[int, torch.Tensor]:
    """(first input pixel, weights (out_size, n)) of PIL's precompute_coeffs for one axis."""
    scale = (stop - start) / out_size
    filter_scale = max(scale, 1.0)
    support = 2.0 * filter_scale  # bicubic's support, widened when downscaling
    centers = start + (np.arange(out_size) + 0.5) * scale
    lo = np.clip(np.trunc(centers - support + 0.5), 0, in_size).astype(np.int64)
    hi = np.clip(np.trunc(centers + support + 0.5), 0, in_size).astype(np.int64)
    first, last = int(lo.min()), int(hi.max())
    pixels = np.arange(first, last)  # (n,)
    dist = (pixels[None, :] - centers[:, None] + 0.5) / filter_scale  # (out, n)
    inside = (pixels[None, :] >= lo[:, None]) & (pixels[None, :] < hi[:, None])
    weights = _bicubic(torch.from_numpy(dist)) * torch.from_numpy(inside)
    weights = weights / weights.sum(1, keepdim=True).clamp_min(1e-12)
    return first, weights.to(device=device, dtype=torch.float32)
