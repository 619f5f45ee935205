"""Catalogues: what a batch-embedding job reads, listed as references to image bytes (no bytes read).

A catalogue is a folder (local path or s3:// prefix), either

- a prepared dataset (it has ``manifest.json``, see ``puma.data.manifest``): one item per row of
  the split's shards; item_id, dataset, label and role are the row's; the bytes are the row's
  ``image`` column, so ``image_uri`` is the shard's URI and ``image_row`` the row in it; or
- images under the prefix (any depth): item_id = ``<catalogue folder name>/<relative path>``,
  dataset = the folder name, label = -1 (NO_LABEL), role = gallery, image_uri = the file,
  image_row = -1. Files without an image extension are counted as ignored, never embedded.

References are a pyarrow table (REF_COLUMNS), so the job can drop what is already indexed before
any image is read or decoded.
"""

from __future__ import annotations

import posixpath

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from puma import storage
from puma.data import schema
from puma.data.manifest import load_manifest
from puma.errors import UserError
from puma.index.table import (
    CATALOGUE,
    DATASET,
    IMAGE_ROW,
    IMAGE_URI,
    ITEM_ID,
    LABEL,
    NO_LABEL,
    ROLE,
    read_columns,
)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
SPLIT = schema.SPLIT
SOURCE_PATH = schema.SOURCE_PATH
REF_COLUMNS = (ITEM_ID, DATASET, LABEL, ROLE, SPLIT, SOURCE_PATH, CATALOGUE, IMAGE_URI, IMAGE_ROW)
SPLITS = {"all": schema.STORED_SPLITS, "train": (schema.TRAIN,), "test": (schema.TEST,)}


class CatalogueError(UserError, ValueError):
    """A catalogue that cannot be embedded; the message names it and what was expected."""


def catalogue_name(uri: str) -> str:
    """The catalogue's folder name (the last path component)."""
    name = posixpath.basename(str(uri).rstrip("/")) if storage.is_s3(uri) else \
        posixpath.basename(storage.absolute(uri).rstrip("/"))
    if not name:
        raise CatalogueError(f"catalogue {uri!r} has no folder name; give a folder, not a bucket root")
    return name


def is_prepared(uri: str) -> bool:
    """True when the catalogue is a prepared dataset (it has manifest.json)."""
    return storage.exists(storage.join(uri, schema.MANIFEST_NAME))


def list_catalogues(prefix: str) -> list[str]:
    """The catalogues under ``prefix``: its immediate sub-folders, sorted."""
    return storage.list_dirs(prefix)


def catalogue_refs(uri: str, split: str = "all") -> tuple[pa.Table, int]:
    """(references to every item of the catalogue, number of non-image files ignored)."""
    uri = storage.absolute(uri)
    refs, ignored = (_prepared_refs(uri, split), 0) if is_prepared(uri) else _image_refs(uri)
    if len(refs) == 0:
        raise CatalogueError(f"catalogue {uri} has no items to embed (split {split!r}); expected a prepared "
                             f"dataset (manifest.json) or image files ({', '.join(IMAGE_SUFFIXES)})")
    return refs, ignored


def _prepared_refs(uri: str, split: str) -> pa.Table:
    """One reference per row of the selected stored splits' shards (image bytes not read)."""
    if split not in SPLITS:
        raise CatalogueError(f"split {split!r} is not valid for {uri}; choose one of {list(SPLITS)}")
    manifest = load_manifest(uri)
    tables = []
    for stored in SPLITS[split]:
        for shard in manifest.shard_uris(stored):
            cols = read_columns(shard, [ITEM_ID, DATASET, LABEL, ROLE, SPLIT, SOURCE_PATH])
            n = len(cols)
            tables.append(cols.append_column(CATALOGUE, pa.array([uri] * n, pa.string()))
                          .append_column(IMAGE_URI, pa.array([shard] * n, pa.string()))
                          .append_column(IMAGE_ROW, pa.array(np.arange(n, dtype=np.int64))))
    if not tables:
        return _empty_refs()
    return _typed(pa.concat_tables(tables))


def _image_refs(uri: str) -> tuple[pa.Table, int]:
    """One reference per image file under the prefix; (refs, non-image files ignored)."""
    files = storage.list_files(uri)
    images = [f for f in files if f.lower().endswith(IMAGE_SUFFIXES)]
    name = catalogue_name(uri)
    base = uri.rstrip("/") + "/"
    rel = [f[len(base):] if f.startswith(base) else posixpath.basename(f) for f in images]
    n = len(images)
    refs = pa.table({ITEM_ID: [schema.make_item_id(name, r) for r in rel], DATASET: [name] * n,
                     LABEL: pa.array(np.full(n, NO_LABEL, np.int64)), ROLE: [schema.GALLERY] * n,
                     SPLIT: [""] * n, SOURCE_PATH: images, CATALOGUE: [uri] * n, IMAGE_URI: images,
                     IMAGE_ROW: pa.array(np.full(n, -1, np.int64))})
    return _typed(refs), len(files) - n


def _empty_refs() -> pa.Table:
    return _typed(pa.table({c: pa.array([], pa.int64() if c in (LABEL, IMAGE_ROW) else pa.string())
                            for c in REF_COLUMNS}))


def _typed(table: pa.Table) -> pa.Table:
    """The reference columns in order with their types (strings, label and image_row int64)."""
    types = {c: pa.int64() if c in (LABEL, IMAGE_ROW) else pa.string() for c in REF_COLUMNS}
    return pa.table({c: table[c].cast(types[c]) for c in REF_COLUMNS})


def without(refs: pa.Table, item_ids: pa.Array) -> tuple[pa.Table, int]:
    """References whose item_id is not in ``item_ids``; (kept, dropped count)."""
    if len(item_ids) == 0 or len(refs) == 0:
        return refs, 0
    seen = pc.is_in(refs[ITEM_ID], value_set=item_ids.cast(pa.string()))
    kept = refs.filter(pc.invert(seen))
    return kept, len(refs) - len(kept)


def check_unique(refs: pa.Table, uri: str) -> None:
    """Raise when item ids repeat within a catalogue (each must name one image)."""
    counts = pc.value_counts(refs[ITEM_ID])
    repeated = counts.filter(pc.greater(counts.field("counts"), 1))
    if len(repeated):
        raise CatalogueError(f"catalogue {uri} has {len(repeated)} repeated item id(s), e.g. "
                             f"{[str(v) for v in repeated.field('values')[:5].to_pylist()]}")
