"""Decode untrusted encoded image bytes with PIL into upright 8-bit RGB, or reject them.

Any PIL-readable format; CMYK, palette, grayscale, LA/RGBA (composited on white) and 16-bit images are
converted to RGB; EXIF orientation is applied. Unreadable data raises ``ImageRejected`` with a reason
from ``puma.data.rejects.DECODE_REASONS``. ``shrink_encoded`` is prepare's optional resize
(``data.prepare_max_side``). The views built from decoded images are puma.data.images'.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import warnings
from collections.abc import Iterator

import numpy as np
from PIL import Image, ImageFile, ImageOps

ImageFile.LOAD_TRUNCATED_IMAGES = False  # a truncated file is a reject, never a grey-padded image
ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


class ImageRejected(ValueError):
    """An image that cannot be used; ``reason`` is one of puma.data.rejects.DECODE_REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@contextlib.contextmanager
def rejects_bad_bytes() -> Iterator[None]:
    """Turn any decoder failure inside the block into ImageRejected (corrupt, truncated, too_large)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    except ImageRejected:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageRejected("too_large", str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - untrusted bytes: every decoder failure is a reject
        text = re.sub(r" <[^>]* at 0x[0-9a-f]+>", "", f"{type(exc).__name__}: {exc}")  # no addresses
        truncated = isinstance(exc, EOFError) or "truncat" in str(exc).lower()
        raise ImageRejected("truncated" if truncated else "corrupt", text) from exc


def check_min_size(size: tuple[int, int], min_size: int) -> None:
    """Reject (tiny) an image whose shorter side is below ``min_size`` (data.min_image_size)."""
    if min(size) < min_size:
        raise ImageRejected("tiny", f"{size[0]}x{size[1]} < {min_size} px")


def decode_image(data: bytes, min_size: int, draft_side: int | None = None) -> Image.Image:
    """RGB image from encoded bytes; raises ImageRejected (corrupt, truncated, tiny, too_large)."""
    with rejects_bad_bytes():
        img = Image.open(io.BytesIO(data))
        check_min_size(img.size, min_size)
        if draft_side and img.format == "JPEG":
            img.draft(None, (draft_side, draft_side))
        img.load()
        ImageOps.exif_transpose(img, in_place=True)  # upright; no copy of an upright image
        return to_rgb(img)


def verify_image(data: bytes) -> None:
    """Raise ImageRejected (corrupt, truncated, too_large) unless ``data`` decodes to its end.

    What prepare checks once per image. JPEGs decode at 1/8 scale (``Image.draft``): the whole
    entropy-coded stream is still read, so truncation is caught, at about a third of a full decode's
    cost; other formats decode fully. The size limit (tiny) is the decoding stage's, not checked here.
    """
    decode_image(data, min_size=1, draft_side=1)


def shrink_encoded(data: bytes, max_side: int) -> bytes | None:
    """Re-encoded bytes of an image whose longer side exceeds ``max_side``, shrunk to it; None if it fits.

    Upright (EXIF orientation applied) and RGB (alpha on white); Lanczos from a DCT-scaled draft of at
    least twice the target size (as Pillow's thumbnail does); JPEG sources stay JPEG (quality 90, 4:2:0
    chroma: embeddings within cosine 0.9995 of the full-size photo's, tests/test_data_prepare.py), others
    become PNG (lossless). An image just above the limit can come out larger than a heavily compressed
    source; the gain is on photos several times the limit. Raises ImageRejected as ``decode_image`` does
    (a shrunk image has been decoded to its end, so it needs no ``verify_image``).
    """
    with rejects_bad_bytes():
        img = Image.open(io.BytesIO(data))
        fmt, (width, height) = img.format, img.size
    if max(width, height) <= max_side:
        return None
    draft = math.ceil(2 * min(width, height) * max_side / max(width, height))
    img = decode_image(data, min_size=1, draft_side=draft)  # upright RGB, at least twice the target
    factor = max_side / max(img.width, img.height)
    size = (max(1, round(img.width * factor)), max(1, round(img.height * factor)))
    small = img.resize(size, Image.Resampling.LANCZOS)
    out = io.BytesIO()
    if fmt == "JPEG":
        small.save(out, format="JPEG", quality=90)
    else:
        small.save(out, format="PNG")
    return out.getvalue()


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode -> RGB (alpha composited on white, 16/32-bit scaled to 8-bit)."""
    if img.mode == "RGB":
        return img
    if img.mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    if img.mode.startswith("I") or img.mode == "F":
        img = _to_8bit(img)
    if img.mode in ALPHA_MODES:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def _to_8bit(img: Image.Image) -> Image.Image:
    """16/32-bit integer or float grayscale -> 8-bit, scaled by the type's range."""
    array = np.asarray(img, dtype=np.float64)
    peak = float(array.max(initial=0))
    if img.mode == "F":
        top = max(peak, 1e-12)
    elif img.mode.startswith("I;16") or 255 < peak <= 65535:
        top = 65535.0
    else:
        top = max(peak, 255.0)
    return Image.fromarray(np.clip(array / top * 255.0 + 0.5, 0, 255).astype(np.uint8), mode="L")


def exif_orientation(img: Image.Image) -> int:
    """The EXIF orientation tag (1: upright, also when absent or unreadable)."""
    try:
        return int(img.getexif().get(0x0112, 1) or 1)
    except Exception:  # noqa: BLE001 - a broken EXIF block: the full decode path handles (or rejects) it
        return 0
