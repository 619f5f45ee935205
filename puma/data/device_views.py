"""A decoded batch as the model's input tensor on the consumer's device (torch, no Ray).

With ``data.decode_on: tasks`` (the default) the Ray Data tasks have already decoded and cropped every
image: ``batch_images`` moves ``image`` (uint8, a quarter of float32's bytes through the object store
and to the device) and normalises it there with the batch's ``view`` column.

With ``data.decode_on: worker`` the tasks read only the header of a plain JPEG (upright, RGB or
grayscale) and plan its view (``images.plan_worker_view``); the consumer decodes it here, on its own
device: nvjpeg through torchvision's batched ``decode_jpeg`` on a GPU, libjpeg-turbo on a CPU. It then
resamples the planned box to img_size with PIL's own filter weights (``resample_boxes``: the same
pixels as the tasks' PIL views, up to the JPEG decoders' rounding), mirrors where planned and
normalises. Images the tasks viewed themselves (PNG, CMYK, EXIF-rotated JPEGs ...) arrive as lossless
PNGs of their views, decoded on the CPU. Prepare verified that every stored image decodes, so a JPEG
that the device's decoder refuses is decoded with PIL on the worker's CPU instead (counted in
``FALLBACKS``), never dropped. Only encoded bytes cross Ray's object store, not decoded pixels.

Batch columns of the worker mode (numpy, B rows; schema.BATCH_*):
    encoded    object (B,) bytes    a JPEG as stored, or a PNG of a view the task made
    crop       float32 (B, 4)       source box (left, top, right, bottom) in the decoded image's pixels
    flip       bool (B,)            mirror the view
    view       float32 (B, 7)       the backbone's mean (3), std (3), then img_size
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch

from puma.data import schema
from puma.data.images import decode_image, levels_affine, normalise_levels

FALLBACKS = {"jpeg_on_cpu": 0}  # JPEGs the device's decoder refused, decoded with PIL instead
JPEG_MAGIC = b"\xff\xd8"


def batch_images(batch: Mapping[str, np.ndarray], device: torch.device | str) -> torch.Tensor:
    """The batch's normalised float32 images (B, 3, S, S) on ``device``, whichever side decoded them."""
    device = torch.device(device)
    if schema.BATCH_ENCODED in batch:
        view = np.asarray(batch[schema.BATCH_VIEW], np.float32)  # (B, 7)
        if not len(view):
            return torch.zeros((0, 3, 0, 0), device=device)
        datas = [bytes(b) for b in batch[schema.BATCH_ENCODED]]
        boxes = np.asarray(batch[schema.BATCH_CROP], np.float64)  # (B, 4)
        flips = np.asarray(batch[schema.BATCH_FLIP], bool)
        views = resample_boxes(decode_images(datas, device), boxes, int(view[0, 6]), flips)  # (B, 3, S, S)
        return _normalise(views, view, device)
    images = torch.as_tensor(np.asarray(batch[schema.BATCH_IMAGE]), device=device)  # (B, 3, S, S)
    if images.dtype != torch.uint8:
        return images  # already normalised (float32 views made elsewhere, e.g. the embedding job's tasks)
    return _normalise(images, np.asarray(batch[schema.BATCH_VIEW], np.float32), device)


def _normalise(views: torch.Tensor, view: np.ndarray, device: torch.device) -> torch.Tensor:
    """8-bit levels (B, 3, S, S), uint8 or float -> (x / 255 - mean) / std with the batch's view column
    (B, 7), as levels * scale + shift (``images.levels_affine``) into one new float32 array: on the CPU
    the same numpy operations as ``images.normalise``, so a CPU batch equals the DataLoader-style
    ``make_view`` bit for bit; the batch's own arrays stay untouched.
    """
    scale, shift = levels_affine(view[:, :3], view[:, 3:6])  # (B, 3) each
    scale, shift = scale[:, :, None, None], shift[:, :, None, None]
    if device.type == "cpu":
        return torch.from_numpy(normalise_levels(views.numpy(), scale, shift))
    out = views.float() if views.dtype != torch.float32 else views.clone()
    return out.mul_(torch.as_tensor(scale, device=device)).add_(torch.as_tensor(shift, device=device))


def decode_images(datas: list[bytes], device: torch.device) -> list[torch.Tensor]:
    """RGB uint8 (3, H, W) tensors on ``device``, in order: JPEGs with ``decode_jpegs``, the tasks' PNG
    views on the CPU."""
    from torchvision.io import ImageReadMode, decode_png

    out: list[torch.Tensor | None] = [None] * len(datas)
    jpegs = [i for i, d in enumerate(datas) if d[:2] == JPEG_MAGIC]
    for i, img in zip(jpegs, decode_jpegs([datas[i] for i in jpegs], device) if jpegs else [], strict=True):
        out[i] = img
    for i in (i for i, img in enumerate(out) if img is None):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchvision >= 0.29 deprecates its decoders
            png = decode_png(torch.frombuffer(bytearray(datas[i]), dtype=torch.uint8), mode=ImageReadMode.RGB)
        out[i] = png.to(device)
    return out


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
    heights = np.asarray([img.shape[-2] for img in images], np.float64)
    widths = np.asarray([img.shape[-1] for img in images], np.float64)
    x0, nx, weights_x = _axis_weights(widths, boxes[:, 0], boxes[:, 2], size, device)  # (N, S, max nx)
    y0, ny, weights_y = _axis_weights(heights, boxes[:, 1], boxes[:, 3], size, device)  # (N, S, max ny)
    regions = torch.zeros((len(images), 3, weights_y.shape[2], weights_x.shape[2]), device=device)
    for i, img in enumerate(images):
        regions[i, :, :ny[i], :nx[i]] = img[:, y0[i]:y0[i] + ny[i], x0[i]:x0[i] + nx[i]]  # uint8 -> float32
    rows = (regions @ weights_x.transpose(1, 2)[:, None]).round_().clamp_(0, 255)  # (N, 3, ny, S)
    views = (weights_y[:, None] @ rows).round_().clamp_(0, 255)  # (N, 3, S, S)
    flip = torch.as_tensor(flips, device=device)
    return torch.where(flip[:, None, None, None], views.flip(-1), views)


def _axis_weights(in_sizes: np.ndarray, starts: np.ndarray, stops: np.ndarray, size: int,
                  device) -> tuple[list[int], list[int], torch.Tensor]:
    """PIL's precompute_coeffs for one axis of N images: (first input pixel, pixels spanned, weights
    (N, size, widest span) on ``device``, zero outside each output pixel's support and the image).

    The supports are found on the CPU (N x size values); the weights are computed on the device in
    float64 from one copy of them, so the CPU cost per batch does not grow with the filter's taps."""
    scale = (stops - starts) / size  # (N,)
    filter_scale = np.maximum(scale, 1.0)
    support = 2.0 * filter_scale  # bicubic's support, widened when downscaling
    centers = starts[:, None] + (np.arange(size) + 0.5) * scale[:, None]  # (N, S)
    lo = np.clip(np.trunc(centers - support[:, None] + 0.5), 0, in_sizes[:, None])
    hi = np.clip(np.trunc(centers + support[:, None] + 0.5), 0, in_sizes[:, None])
    first = lo.min(1)
    span = hi.max(1) - first
    taps = int((hi - lo).max())
    params = np.stack([centers - first[:, None], lo - first[:, None], hi - first[:, None],
                       np.broadcast_to(filter_scale[:, None], centers.shape)])  # (4, N, S), relative to first
    center, low, high, fs = torch.from_numpy(params).to(device)[..., None]  # each (N, S, 1)
    pixels = low + torch.arange(taps, device=device, dtype=torch.float64)  # (N, S, taps)
    weights = _bicubic((pixels - center + 0.5) / fs) * (pixels < high)
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-12)
    index = torch.minimum(pixels, high - 1).long()
    dense = torch.zeros((len(in_sizes), size, int(span.max())), device=device)
    dense.scatter_add_(2, index, weights.float())
    return first.astype(int).tolist(), span.astype(int).tolist(), dense


def _bicubic(x: torch.Tensor, a: float = -0.5) -> torch.Tensor:
    """PIL's bicubic filter (Keys, a = -0.5)."""
    x = x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def prefetched(batches: Iterable[Mapping[str, np.ndarray]], device: torch.device | str,
               depth: int = 2) -> Iterator[tuple[Mapping[str, np.ndarray], torch.Tensor]]:
    """(batch, ``batch_images(batch, device)``) for each batch, the next ``depth`` made ahead in a
    background thread: the worker's decoding (data.decode_on=worker) runs while the training step waits
    for the GPU instead of after it. Kernels go to the same stream as the step's, so the order on the
    device is the sequential one. An error in the thread is raised here; leaving the loop early stops it.
    """
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for batch in batches:
                if not put((batch, batch_images(batch, device))):
                    return
            put(done)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            put(exc)

    thread = threading.Thread(target=work, name="puma-batch-images", daemon=True)
    thread.start()
    try:
        while (item := ready.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=10)
