"""Rejected images and catalogue rows: one JSON object per line, sorted by item id, never silently dropped.

Rejects are found once: prepare reads and decodes every image (``puma.data.images.verify_image``)
and lists what fails in ``<data.uri>/rejects/prepare.jsonl``; those items never enter a shard.
Training (``data.rejects_uri``) and embedding (``<index.uri>/rejects/<catalogue>.jsonl``) start
their rejects files from that list, so each one lists every bad item of what it read, and add what
only they meet. Reasons, by the stage that finds them:

- catalogue (reading a catalogue table, ``puma.data.tables``; ``detail`` names the table and row):
  ``empty_item_id`` (no item_id: the reject's item_id is ``<row N>``), ``missing_image_uri`` (no
  image_uri), ``duplicate_item_id`` (an item_id already on an earlier row, which is kept), and, when
  prepare reads a table whose rows have labels, ``missing_label`` (a row without one).
- prepare: ``missing_file`` (listed by the release but absent), ``empty_file`` (zero bytes),
  ``corrupt`` (not a readable image), ``truncated`` (the encoded data ends early), ``too_large``
  (a decompression bomb by PIL's limit).
- decode (training, embedding): ``tiny`` (shorter side below the job's ``data.min_image_size``),
  and the prepare reasons for images that got past an older prepare or an image-folder catalogue,
  which is not prepared.

CMYK, palette, grayscale, 16-bit and alpha images are not rejects: they are converted to RGB.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from puma import storage

PREPARE_REASONS = ("missing_file", "empty_file", "corrupt", "truncated", "too_large")
DECODE_REASONS = ("corrupt", "truncated", "tiny", "too_large")
TABLE_REASONS = ("empty_item_id", "missing_image_uri", "duplicate_item_id", "missing_label")


@dataclass(frozen=True)
class Reject:
    """One rejected image and why."""

    item_id: str
    dataset: str
    reason: str
    stage: str  # catalogue | prepare | decode
    source_path: str = ""
    split: str = ""
    detail: str = ""
    stamp: str = ""  # embedding: the listing's stamp of the image when it was rejected ('' unknown)

    def to_dict(self) -> dict:
        """The row as written; ``stamp`` only when known (so other stages' rows are unchanged)."""
        row = asdict(self)
        if not row["stamp"]:
            row.pop("stamp")
        return row


def dumps(rejects: Iterable[Reject | dict]) -> str:
    """JSONL text, one reject per item id (the first seen wins), sorted by item id."""
    rows: dict[str, dict] = {}
    for r in rejects:
        row = r.to_dict() if isinstance(r, Reject) else dict(r)
        rows.setdefault(row["item_id"], row)
    return "".join(json.dumps(rows[k], sort_keys=True) + "\n" for k in sorted(rows))


def write_rejects(uri: str, rejects: Iterable[Reject | dict]) -> bool:
    """Write the rejects file unless it already holds exactly this text; True if written."""
    text = dumps(rejects)
    if storage.exists(uri) and storage.read_text(uri) == text:
        return False
    storage.write_text(uri, text)
    return True


def read_rejects(uri: str) -> list[dict]:
    """The rows of a rejects file ([] when it does not exist)."""
    if not storage.exists(uri):
        return []
    return [json.loads(line) for line in storage.read_text(uri).splitlines() if line.strip()]


def reject_counts(rows: Iterable[dict]) -> dict[str, int]:
    """Rejects per reason."""
    return dict(sorted(Counter(r["reason"] for r in rows).items()))
