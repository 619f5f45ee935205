"""Retrieval grid: one PNG row per query, the query image then its top-k results (PIL only).

Each cell is a TILE x TILE image inside a BORDER px frame, with a caption below (rank and score,
then the item id). Frames: the query blue; a result green when it matches the query (same dataset
and same label, both labels known, i.e. != -1), red when both labels are known and differ, grey
when either label is unknown. Images are read through puma.storage from ``image_uri`` (an image
file when ``image_row`` is -1, else row ``image_row`` of the Parquet file at ``image_uri``, column
``image``); a missing or unreadable image becomes a placeholder tile naming the item, never an error.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFont, ImageOps

from puma import storage
from puma.data.images import decode_image
from puma.index.table import NO_LABEL, read_rows

log = logging.getLogger(__name__)
TILE = 128  # image area of a cell, px
BORDER = 5  # frame width, px
CAPTION = 28  # two text lines under the image, px
CELL_W, CELL_H = TILE + 2 * BORDER, TILE + 2 * BORDER + CAPTION
IMAGE_COLUMN = "image"  # the encoded bytes column of prepared-data Parquet (puma.data.schema.IMAGE)
FRAMES = {"query": (40, 90, 210), "match": (0, 170, 0), "mismatch": (215, 25, 25), "unknown": (170, 170, 170)}
BACKGROUND, PLACEHOLDER, TEXT = (255, 255, 255), (225, 225, 225), (20, 20, 20)


@dataclass
class GridItem:
    """One cell: an item, where its image is, its class if known, and its rank / score as a result."""

    item_id: str
    image_uri: str = ""  # '' = no image (placeholder)
    image_row: int = -1
    dataset: str = ""
    label: int = NO_LABEL
    rank: int = 0  # 0 for the query
    score: float | None = None


def match_status(query: GridItem, result: GridItem) -> str:
    """'match' / 'mismatch' when both labels are known (same dataset and label), else 'unknown'."""
    if query.label == NO_LABEL or result.label == NO_LABEL:
        return "unknown"
    same = query.dataset == result.dataset and query.label == result.label
    return "match" if same else "mismatch"


def read_image_bytes(image_uri: str, image_row: int) -> bytes:
    """Encoded bytes of an image file, or of row ``image_row`` of a Parquet file's image column."""
    if image_row < 0:
        return storage.read_bytes(image_uri)
    table = read_rows(image_uri, np.array([image_row], dtype=np.int64), [IMAGE_COLUMN])
    return table[IMAGE_COLUMN][0].as_py()


def image_tile(item: GridItem) -> Image.Image:
    """The item's image fitted into TILE x TILE on white, or a placeholder naming the item."""
    if not item.image_uri:
        return placeholder_tile(item.item_id, "no image")  # e.g. a query given as a vector
    try:
        img = decode_image(read_image_bytes(item.image_uri, item.image_row), min_size=1, draft_side=TILE)
    except Exception as exc:  # noqa: BLE001 - any unreadable image becomes a placeholder, never a crash
        log.warning("retrieval grid: no image for %s (%s)", item.item_id, exc)
        return placeholder_tile(item.item_id)
    fitted = ImageOps.contain(img, (TILE, TILE), Image.Resampling.BICUBIC)
    tile = Image.new("RGB", (TILE, TILE), BACKGROUND)
    tile.paste(fitted, ((TILE - fitted.width) // 2, (TILE - fitted.height) // 2))
    return tile


def placeholder_tile(item_id: str, why: str = "image missing") -> Image.Image:
    """A grey TILE x TILE tile saying why there is no image, with the item id wrapped on it."""
    tile = Image.new("RGB", (TILE, TILE), PLACEHOLDER)
    draw = ImageDraw.Draw(tile)
    lines = [why] + [item_id[i:i + 20] for i in range(0, min(len(item_id), 100), 20)]
    for i, line in enumerate(lines):
        draw.text((4, 6 + 12 * i), line, fill=TEXT, font=_font())
    return tile


def _font() -> ImageFont.ImageFont:
    return ImageFont.load_default()


def cell(item: GridItem, frame: str) -> Image.Image:
    """A CELL_W x CELL_H cell: framed tile and its caption."""
    out = Image.new("RGB", (CELL_W, CELL_H), BACKGROUND)
    ImageDraw.Draw(out).rectangle((0, 0, CELL_W - 1, TILE + 2 * BORDER - 1), fill=FRAMES[frame])
    out.paste(image_tile(item), (BORDER, BORDER))
    score = "" if item.score is None else f"  {item.score:.3f}"
    head = "query" if item.rank == 0 else f"#{item.rank}{score}"
    draw = ImageDraw.Draw(out)
    draw.text((BORDER, TILE + 2 * BORDER + 1), head, fill=TEXT, font=_font())
    draw.text((BORDER, TILE + 2 * BORDER + 14), _shorten(item.item_id), fill=TEXT, font=_font())
    return out


def _shorten(text: str, limit: int = 21) -> str:
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


def retrieval_grid(queries: list[GridItem], results: list[list[GridItem]]) -> Image.Image:
    """The grid image: len(queries) rows x (1 + k) cells; result rows may be shorter (empty cells)."""
    if len(queries) != len(results) or not queries:
        raise ValueError(f"need one result list per query, got {len(queries)} queries, {len(results)} lists")
    k = max(len(r) for r in results)
    grid = Image.new("RGB", ((1 + k) * CELL_W, len(queries) * CELL_H), BACKGROUND)
    for row, (query, found) in enumerate(zip(queries, results, strict=True)):
        grid.paste(cell(query, "query"), (0, row * CELL_H))
        for col, result in enumerate(found, start=1):
            grid.paste(cell(result, match_status(query, result)), (col * CELL_W, row * CELL_H))
    return grid


def write_grid(uri: str, grid: Image.Image) -> str:
    """Save the grid as PNG at ``uri`` (local or s3://)."""
    buf = io.BytesIO()
    grid.save(buf, format="PNG")
    storage.write_bytes(uri, buf.getvalue())
    return uri
