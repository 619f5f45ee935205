"""What a run must do to bring a catalogue's part of the index to the catalogue as it is now.

    catalogue references (stamp from the listing)  x  the index's live items of that catalogue
      new        item id not indexed for this catalogue          -> read, decode, embed, add
      changed    image differs from the one embedded             -> read, decode, embed, replace
      restamped  same image bytes, new stamp or new metadata     -> stored embedding re-added
                 (a file rewritten with the same bytes, a table row whose other columns changed)
      removed    indexed for this catalogue, gone from it        -> removed when the run commits
      unchanged  same stamp, same metadata                       -> nothing read

An image is unchanged when its stamp (size and write time from the listing, or a prepared
shard and row) equals the stamp stored with the item: it is not read at all. When the stamps
differ, the bytes are read (not decoded) and their sha256 compared with the stored fingerprint,
so a rewritten but identical file is not embedded again. Rows indexed before fingerprints were
stored have none and are embedded again once.

An item id indexed from another catalogue cannot be taken by this one: such rows are rejects
(``duplicate_item_id``), so a hit's item id names one image.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from puma import storage
from puma.data.rejects import Reject
from puma.index.manifest import Manifest, ShardEntry, live_rows
from puma.index.table import (
    CATALOGUE,
    CLASS_NAME,
    DATASET,
    FINGERPRINT,
    INDEX_ID,
    ITEM_ID,
    LABEL,
    METADATA,
    ROLE,
    STAMP,
    read_columns,
    read_rows,
)
from puma.inference.embedder import fingerprint, read_image_bytes

log = logging.getLogger(__name__)
STATE_COLUMNS = [INDEX_ID, ITEM_ID, CATALOGUE, STAMP, FINGERPRINT, METADATA, LABEL, DATASET, CLASS_NAME, ROLE]
DESCRIBED_BY = (METADATA, LABEL, DATASET, CLASS_NAME)  # an item's columns besides its image


@dataclass
class Plan:
    """The changes of one catalogue against the index, and where the old rows are."""

    embed: pa.Table  # references to read, decode and embed: new items, then changed ones
    new: int = 0
    changed: int = 0
    restamped: pa.Table | None = None  # stored rows to add again with the listing's stamp / metadata
    removed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # global ids, gone items
    replaced: dict = field(default_factory=dict)  # item id -> global id of its row now live (changed)
    unchanged: int = 0
    indexed: int = 0  # live rows of this catalogue before the run
    hashed: int = 0  # images read (not decoded) because their stamp changed
    rejects: list[dict] = field(default_factory=list)  # item ids indexed from another catalogue

    @property
    def restamp_count(self) -> int:
        return 0 if self.restamped is None else len(self.restamped)


def live_items(uri: str, manifest: Manifest | None) -> pa.Table:
    """STATE_COLUMNS of every live row of the index (removed rows left out; none without a manifest)."""
    parts = [_live(uri, shard) for shard in manifest.shards] if manifest is not None else []
    if not parts:
        return pa.table({c: pa.array([], pa.int64() if c in (INDEX_ID, LABEL) else pa.string())
                         for c in STATE_COLUMNS})
    return pa.concat_tables(parts, promote_options="permissive")


def _live(uri: str, shard: ShardEntry) -> pa.Table:
    table = read_columns(_embeddings(uri, shard), STATE_COLUMNS, missing_ok=True)
    table = table.set_column(table.schema.get_field_index(LABEL), LABEL, table[LABEL].cast(pa.int64()))
    for c in (CATALOGUE, STAMP, FINGERPRINT, METADATA, DATASET, CLASS_NAME, ROLE):
        table = table.set_column(table.schema.get_field_index(c), c, table[c].cast(pa.string()))
    if not shard.removed_count:
        return table
    return table.filter(pa.array(live_rows(uri, shard)))


def plan(refs: pa.Table, catalogue: str, live: pa.Table) -> Plan:
    """Compare the catalogue's references with the index's live rows (reads only stamp-changed images)."""
    mine = live.filter(pc.equal(live[CATALOGUE], catalogue))
    others = live.filter(pc.invert(pc.equal(live[CATALOGUE], catalogue).fill_null(False)))
    refs, rejects = _without_taken(refs, others, catalogue)
    row_of = pc.index_in(refs[ITEM_ID], value_set=mine[ITEM_ID])  # each ref's row in `mine`, or null
    known = row_of.is_valid().to_numpy(zero_copy_only=False)
    stored = mine.take(pc.fill_null(row_of, 0)) if len(mine) else None
    same_stamp = _equal(refs[STAMP], stored[STAMP]) & known if stored is not None else known
    same_desc = _same_description(refs, stored) if stored is not None else known
    check = known & ~same_stamp  # read + hash these, compare with the stored fingerprint
    same_bytes = same_stamp.copy()
    if check.any():
        same_bytes[check] = _hash_equal(refs.filter(pa.array(check)), stored.filter(pa.array(check)))
    changed = known & ~same_bytes
    restamp = known & same_bytes & ~(same_stamp & same_desc)
    gone = pc.invert(pc.is_in(mine[ITEM_ID], value_set=refs[ITEM_ID])).to_numpy(zero_copy_only=False)
    new = ~known
    result = Plan(embed=pa.concat_tables([refs.filter(pa.array(new)), refs.filter(pa.array(changed))]),
                  new=int(new.sum()), changed=int(changed.sum()),
                  removed=mine[INDEX_ID].to_numpy()[gone].astype(np.int64),
                  unchanged=int((known & same_bytes & same_stamp & same_desc).sum()), indexed=len(mine),
                  hashed=int(check.sum()),
                  rejects=rejects)
    if stored is not None:
        old = stored[INDEX_ID].to_numpy(zero_copy_only=False)
        ids = refs[ITEM_ID].to_pylist()
        result.replaced = {ids[i]: int(old[i]) for i in np.flatnonzero(changed | restamp)}
        result.restamped = _restamp_source(refs.filter(pa.array(restamp)), stored.filter(pa.array(restamp)))
    log.info("catalogue %s: %d new, %d changed, %d restamped, %d removed, %d unchanged (%d image(s) read to "
             "compare)", catalogue, result.new, result.changed, result.restamp_count, len(result.removed),
             result.unchanged, result.hashed)
    return result


def restamped_rows(uri: str, manifest: Manifest, plan_: Plan) -> pa.Table | None:
    """The stored rows (embedding included) of the restamped items, with the listing's new stamp and
    description columns: what the final commit adds in place of the old rows."""
    source = plan_.restamped
    if source is None or not len(source):
        return None
    ids = source[INDEX_ID].to_numpy()
    starts = np.array([s.id_start for s in manifest.shards], dtype=np.int64)
    shard_of = np.searchsorted(starts, ids, side="right") - 1
    parts, order = [], []
    for i in np.unique(shard_of):
        rows = np.flatnonzero(shard_of == i)
        shard = manifest.shards[i]
        parts.append(_read_all_columns(uri, shard, ids[rows] - shard.id_start))
        order.append(rows)
    table = pa.concat_tables(parts, promote_options="permissive")
    table = table.take(pa.array(np.argsort(np.concatenate(order), kind="stable")))
    for c in (STAMP, *DESCRIBED_BY):
        value = source[c].cast(table.schema.field(c).type) if c in table.column_names else source[c]
        table = (table.set_column(table.schema.get_field_index(c), c, value) if c in table.column_names
                 else table.append_column(c, value))
    return table.drop_columns([INDEX_ID])


def _read_all_columns(uri: str, shard: ShardEntry, rows: np.ndarray) -> pa.Table:
    import pyarrow.parquet as pq

    fs, path = storage.resolve(_embeddings(uri, shard))
    with fs.open_input_file(path) as f:
        names = pq.ParquetFile(f).schema_arrow.names
    return read_rows(_embeddings(uri, shard), rows, names)


def reject_rows(refs: pa.Table, item_ids: list[str], reason: str, detail: str) -> list[dict]:
    """Reject rows (puma.data.rejects format) for the named references."""
    chosen = refs.filter(pc.is_in(refs[ITEM_ID], value_set=pa.array(item_ids, pa.string())))
    return [Reject(item_id=r[ITEM_ID], dataset=r[DATASET], reason=reason, stage="catalogue",
                   source_path=r["source_path"], detail=detail).to_dict() for r in chosen.to_pylist()]


def _without_taken(refs: pa.Table, others: pa.Table, catalogue: str) -> tuple[pa.Table, list[dict]]:
    """References whose item id another catalogue has indexed are left out and listed as rejects."""
    taken = pc.is_in(refs[ITEM_ID], value_set=others[ITEM_ID]) if len(others) else None
    if taken is None or not pc.any(taken).as_py():
        return refs, []
    clash = refs.filter(taken)
    owner = others.take(pc.index_in(clash[ITEM_ID], value_set=others[ITEM_ID]))[CATALOGUE].to_pylist()
    rejects = []
    for ref, where in zip(clash.to_pylist(), owner, strict=True):
        rejects.append(Reject(item_id=ref[ITEM_ID], dataset=ref[DATASET], reason="duplicate_item_id",
                              stage="catalogue", source_path=ref["source_path"],
                              detail=f"item id already indexed from catalogue {where}").to_dict())
    log.warning("catalogue %s: %d item id(s) are indexed from other catalogues; rejected", catalogue,
                len(rejects))
    return refs.filter(pc.invert(taken)), rejects


def _equal(a: pa.ChunkedArray, b: pa.ChunkedArray) -> np.ndarray:
    """Element-wise equality of two string columns, nulls equal to nothing."""
    return pc.equal(a, b).fill_null(False).to_numpy(zero_copy_only=False)


def _same_description(refs: pa.Table, stored: pa.Table) -> np.ndarray:
    """Whether each reference's label, dataset, class name and metadata are the stored ones."""
    same = np.ones(len(refs), dtype=bool)
    for c in DESCRIBED_BY:
        ref_col = refs[c].cast(pa.string())
        stored_col = stored[c].cast(pa.string())
        if c == METADATA:  # rows indexed before metadata existed have none: '{}' is the same
            stored_col = pc.fill_null(stored_col, "{}")
        if c == CLASS_NAME:
            stored_col = pc.fill_null(stored_col, "")
        same &= _equal(ref_col, stored_col)
    return same


def _hash_equal(refs: pa.Table, stored: pa.Table) -> np.ndarray:
    """Read each image (not decode) and compare its sha256 with the stored fingerprint."""
    data = read_image_bytes(refs)
    prints = [None if isinstance(d, Exception) or not d else fingerprint(bytes(d)) for d in data]
    old = stored[FINGERPRINT].to_pylist()
    return np.array([p is not None and p == o for p, o in zip(prints, old, strict=True)], dtype=bool)


def _restamp_source(refs: pa.Table, stored: pa.Table) -> pa.Table:
    """Global id of each restamped item's row, with the listing's stamp and description columns."""
    return pa.table({INDEX_ID: stored[INDEX_ID], ITEM_ID: refs[ITEM_ID], STAMP: refs[STAMP],
                     **{c: refs[c] for c in DESCRIBED_BY}})


def _embeddings(uri: str, shard: ShardEntry) -> str:
    return storage.join(uri, *shard.embeddings.path.split("/"))
