"""Catalogues: what a batch-embedding job reads, listed as references to image bytes (no bytes read).

A catalogue is

- a prepared dataset (a folder with ``manifest.json``, see ``puma.data.manifest``): one item per
  row of the split's shards; item_id, dataset, label and role are the row's; the bytes are the
  row's ``image`` column, so ``image_uri`` is the shard's URI and ``image_row`` the row in it;
- images under a folder or prefix (any depth): item_id = ``<catalogue folder name>/<relative
  path>``, dataset = the folder name, label = -1 (NO_LABEL), role = gallery, image_uri = the file,
  image_row = -1. Files without an image extension are counted as ignored, never embedded; or
- a table (``.csv``, ``.jsonl`` or ``.parquet``, see ``puma.data.tables``): one item per row,
  item_id and image_uri from the row, label / dataset when given, every other column as the
  item's ``metadata`` (JSON). Bad rows (empty or repeated item id, no image_uri) are rejects.

References are a pyarrow table (REF_COLUMNS; the repeated string columns dictionary-encoded, ``plain``
decodes them), so the job can drop what is indexed and unchanged before any image is read or decoded.
``stamp`` is what the listing says of the image (size and write time of a file, or shard and row of a
prepared item): when it is the stamp stored with the indexed item, the image is unchanged and is not
read (``puma.inference.reconcile``). A table's images are stamped once per distinct image, local files
in one call and S3 objects by listing the folders the table points into (one request per 1,000 keys)
where that takes fewer requests than a HEAD per object (``puma.storage.stat_files``).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from puma import storage
from puma.data import schema
from puma.data.columns import first_rows, scatter_rows, take_rows
from puma.data.manifest import load_manifest
from puma.data.tables import TABLE_SUFFIXES, is_table, read_item_table
from puma.errors import UserError
from puma.index.table import (
    CATALOGUE,
    CLASS_NAME,
    DATASET,
    FINGERPRINT,
    IMAGE_ROW,
    IMAGE_URI,
    ITEM_ID,
    LABEL,
    METADATA,
    NO_LABEL,
    ROLE,
    STAMP,
    read_columns,
)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
SPLIT = schema.SPLIT
SOURCE_PATH = schema.SOURCE_PATH
REF_COLUMNS = (ITEM_ID, DATASET, LABEL, CLASS_NAME, ROLE, SPLIT, SOURCE_PATH, CATALOGUE, IMAGE_URI, IMAGE_ROW,
               METADATA, STAMP, FINGERPRINT)
INT_COLUMNS = (LABEL, IMAGE_ROW)
SPLITS = {"all": schema.STORED_SPLITS, "train": (schema.TRAIN,), "test": (schema.TEST,)}
STAT_BATCH = 100_000  # files stamped per storage.stat_files call (its Python objects live that long)


class CatalogueError(UserError, ValueError):
    """A catalogue that cannot be embedded; the message names it and what was expected."""


def catalogue_name(uri: str) -> str:
    """The catalogue's folder name (the last path component; a table's file name without suffix)."""
    name = posixpath.basename(str(uri).rstrip("/")) if storage.is_s3(uri) else \
        posixpath.basename(storage.absolute(uri).rstrip("/"))
    if is_table(name):
        name = name.rsplit(".", 1)[0]
    if not name:
        raise CatalogueError(f"catalogue {uri!r} has no folder name; give a folder, not a bucket root")
    return name


def is_prepared(uri: str) -> bool:
    """True when the catalogue is a prepared dataset (it has manifest.json)."""
    return storage.exists(storage.join(uri, schema.MANIFEST_NAME))


def list_catalogues(prefix: str) -> list[str]:
    """The catalogues under ``prefix``: its immediate sub-folders and its table files, sorted."""
    tables = [f for f in storage.list_files(prefix, recursive=False) if is_table(f)]
    return sorted(storage.list_dirs(prefix) + tables)


@dataclass
class Listing:
    """A catalogue as listed: its references, non-image files ignored, rows rejected by the listing."""

    refs: pa.Table
    ignored: int = 0
    rejects: list[dict] = field(default_factory=list)


def catalogue_refs(uri: str, split: str = "all") -> tuple[pa.Table, int]:
    """(references to every item of the catalogue, number of non-image files ignored)."""
    listing = list_catalogue(uri, split)
    return listing.refs, listing.ignored


def list_catalogue(uri: str, split: str = "all", stamp_column: str = "") -> Listing:
    """Every item of the catalogue as a reference (no image read), with what the listing rejected;
    ``stamp_column``: a table's column stamping its rows' images (embed.stamp_column, see _table_refs)."""
    uri = storage.absolute(uri)
    if is_table(uri):
        listing = _table_refs(uri, stamp_column)
    elif is_prepared(uri):
        listing = Listing(_prepared_refs(uri, split))
    else:
        listing = _image_refs(uri)
    if len(listing.refs) == 0 and not listing.rejects:
        raise CatalogueError(f"catalogue {uri} has no items to embed (split {split!r}); expected a prepared "
                             f"dataset (manifest.json), image files ({', '.join(IMAGE_SUFFIXES)}) or a table "
                             f"({', '.join(TABLE_SUFFIXES)}) with item_id and image_uri columns")
    return listing


def _prepared_refs(uri: str, split: str) -> pa.Table:
    """One reference per row of the selected stored splits' shards (image bytes not read)."""
    if split not in SPLITS:
        raise CatalogueError(f"split {split!r} is not valid for {uri}; choose one of {list(SPLITS)}")
    manifest = load_manifest(uri)
    tables = []
    for stored in SPLITS[split]:
        for shard in manifest.shard_uris(stored):
            cols = read_columns(shard, [ITEM_ID, DATASET, LABEL, CLASS_NAME, ROLE, SPLIT, SOURCE_PATH])
            n = len(cols)
            rows = pa.array(np.arange(n, dtype=np.int64))
            # shards are content-addressed (their name is their sha256): shard + row names the bytes
            stamps = pc.binary_join_element_wise(f"{posixpath.basename(shard)}#", rows.cast(pa.string()), "")
            tables.append(cols.append_column(CATALOGUE, constant(uri, n))
                          .append_column(IMAGE_URI, constant(shard, n))
                          .append_column(IMAGE_ROW, rows)
                          .append_column(STAMP, stamps))
    if not tables:
        return _empty_refs()
    return _typed(pa.concat_tables(tables, promote_options="permissive"))


def _image_refs(uri: str) -> Listing:
    """One reference per image file under the prefix, stamped by the listing (no file opened)."""
    files = storage.list_file_stats(uri)
    images = [f for f in files if f.uri.lower().endswith(IMAGE_SUFFIXES)]
    name = catalogue_name(uri)
    base = uri.rstrip("/") + "/"
    paths = pa.array([f.uri for f in images], pa.string())
    n = len(images)
    inside = pc.starts_with(paths, base)
    rel = pc.if_else(inside, pc.utf8_slice_codeunits(paths, len(base)),
                     pc.replace_substring_regex(paths, r"^.*/", ""))  # else the file name
    rel = pc.utf8_ltrim(pc.replace_substring(rel, "\\", "/"), "/")  # as schema.make_item_id
    sizes = np.fromiter((f.size for f in images), np.int64, n)
    times = np.fromiter((f.mtime_ns for f in images), np.int64, n)
    refs = pa.table({ITEM_ID: pc.binary_join_element_wise(f"{name}/", rel, ""), DATASET: constant(name, n),
                     LABEL: pa.array(np.full(n, NO_LABEL, np.int64)), ROLE: constant(schema.GALLERY, n),
                     SPLIT: constant("", n), SOURCE_PATH: paths, CATALOGUE: constant(uri, n),
                     IMAGE_URI: paths, IMAGE_ROW: pa.array(np.full(n, -1, np.int64)),
                     STAMP: stamps(sizes, times)})
    return Listing(_typed(refs), len(files) - n)


def _table_refs(uri: str, stamp_column: str = "") -> Listing:
    """One reference per valid row of a catalogue table. Its image's stamp: ``@<stamp_column>=<value>``
    when a stamp column is named and the row's cell is not empty (no storage request at all), else the
    image's size and write time, each distinct image asked once (storage.stat_files: S3 folders are
    listed where that takes fewer requests than a HEAD per image)."""
    table = read_item_table(uri, catalogue_name(uri), stamp_column)
    rows = table.rows
    n = len(rows)
    images = rows[IMAGE_URI]
    given = None if not stamp_column else pc.not_equal(table.versions, "")
    stamp = _file_stamps(images if given is None else images.filter(pc.invert(given)))
    if given is not None:
        versions = pc.binary_join_element_wise(f"@{stamp_column}=", table.versions, "")
        stamp = scatter_rows(versions, np.flatnonzero(~given.to_numpy(zero_copy_only=False)), stamp)
    refs = pa.table({ITEM_ID: rows[ITEM_ID], DATASET: rows[DATASET].dictionary_encode(),
                     LABEL: rows[LABEL], CLASS_NAME: rows[CLASS_NAME].dictionary_encode(),
                     ROLE: constant(schema.GALLERY, n), SPLIT: constant("", n), SOURCE_PATH: images,
                     CATALOGUE: constant(uri, n), IMAGE_URI: images,
                     IMAGE_ROW: pa.array(np.full(n, -1, np.int64)), METADATA: rows[METADATA], STAMP: stamp})
    return Listing(_typed(refs), 0, table.rejects)


def _file_stamps(images: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Each image's ``<size>:<mtime_ns>`` ('' when missing), every distinct image asked once, STAT_BATCH
    at a time (dictionary-encoded when images repeat)."""
    first = first_rows(images)  # (N,) each row's first row with its image
    own = first == np.arange(len(first))
    distinct = images if own.all() else take_rows(images, np.flatnonzero(own))
    parts = [storage.stat_arrays(distinct.slice(lo, STAT_BATCH).to_pylist())
             for lo in range(0, len(distinct), STAT_BATCH)]
    sizes, times, found = (np.concatenate([p[j] for p in parts]) if parts else np.zeros(0, t)
                           for j, t in enumerate((np.int64, np.int64, bool)))
    text = stamps(sizes, times, found)
    if own.all():
        return text
    codes = (np.cumsum(own) - 1)[first]  # each row's image among the distinct ones
    if 2 * len(distinct) > len(images):
        return take_rows(text, codes)
    return pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int32)), text)


def stamps(sizes: np.ndarray, mtimes_ns: np.ndarray, found: np.ndarray | None = None) -> pa.Array:
    """``<size>:<mtime_ns>`` per file (storage.FileStat.stamp), '' where ``found`` is False."""
    text = [pa.array(v, pa.int64()).cast(pa.string()) for v in (sizes, mtimes_ns)]
    out = pc.binary_join_element_wise(*text, ":")
    return out if found is None or found.all() else pc.if_else(pa.array(found), out, "")


def constant(value: str, n: int) -> pa.DictionaryArray:
    """``n`` times ``value``, dictionary-encoded (a byte a row): a catalogue's repeated columns."""
    return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int8)), pa.array([value], pa.string()))


def _empty_refs() -> pa.Table:
    return _typed(pa.table({c: pa.array([], pa.int64() if c in INT_COLUMNS else pa.string())
                            for c in REF_COLUMNS}))


DEFAULTS = {CLASS_NAME: "", METADATA: "{}", STAMP: "", FINGERPRINT: ""}
DICTIONARY = pa.dictionary(pa.int32(), pa.string())


def _typed(table: pa.Table) -> pa.Table:
    """The reference columns in order with their types (strings, label and image_row int64; a string
    column may be dictionary-encoded, as the repeated ones are); the optional ones a listing does not give
    are filled with their defaults."""
    columns = {}
    for c in REF_COLUMNS:
        if c in table.column_names:
            kind = table[c].type
            if c in INT_COLUMNS or not (pa.types.is_dictionary(kind) and kind.value_type == pa.string()):
                kind = pa.int64() if c in INT_COLUMNS else pa.string()
            columns[c] = table[c].cast(kind)
            if c in DEFAULTS and columns[c].null_count:
                columns[c] = pc.fill_null(columns[c], DEFAULTS[c])
        else:
            columns[c] = constant(DEFAULTS[c], len(table))
    return pa.table(columns)


def plain(table: pa.Table) -> pa.Table:
    """``table`` with its dictionary-encoded columns decoded (what a writer or a Ray block gets)."""
    for i, f in enumerate(table.schema):
        if pa.types.is_dictionary(f.type):
            table = table.set_column(i, f.name, table[f.name].cast(f.type.value_type))
    return table


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
