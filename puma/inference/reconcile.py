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

At the size catalogues have (millions of rows, about 1% changed a night) the plan is columnar and
holds about the references plus 40 bytes a live row, never a Python object per unchanged item:

    live_items   every shard's item_id, global id, catalogue and role (dictionary-encoded)
    plan         one lookup of the references' item ids in those keys (puma.data.columns.find_rows);
                 then shard by shard, the stamp, metadata, label, dataset and class name of the
                 rows found are read (only their row groups) and compared with the references'
                 columns; the stored fingerprints only of the rows whose stamp changed
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from puma import storage
from puma.data.columns import find_rows, take_rows
from puma.data.rejects import Reject
from puma.index.layout import IndexFolder
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
    read_rows,
)
from puma.inference.catalogue import DICTIONARY, plain
from puma.inference.embedder import fingerprint, read_image_bytes, share_images

log = logging.getLogger(__name__)
KEY_COLUMNS = [INDEX_ID, ITEM_ID, CATALOGUE, ROLE]  # what a plan holds of every live row
DESCRIBED_BY = (METADATA, LABEL, DATASET, CLASS_NAME)  # an item's columns besides its image
COMPARED = [STAMP, *DESCRIBED_BY]  # read shard by shard for the known items (fingerprints: stamp changed)


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


@dataclass
class LiveItems:
    """The index's live rows as keys (KEY_COLUMNS; catalogue and role dictionary-encoded): a plan reads
    their other columns shard by shard, only for the items the catalogue still lists."""

    uri: str
    manifest: Manifest | None
    keys: pa.Table

    def __len__(self) -> int:
        return len(self.keys)

    def where(self, mask: pa.ChunkedArray | pa.Array) -> LiveItems:
        """The rows where ``mask`` is True."""
        return LiveItems(self.uri, self.manifest, self.keys.filter(mask))


def live_items(uri: str, manifest: Manifest | None) -> LiveItems:
    """KEY_COLUMNS of every live row of the index, shard by shard (removed rows left out; none without a
    manifest): about 30 bytes a row besides the item id."""
    parts = [_live_keys(uri, shard) for shard in manifest.shards] if manifest is not None else []
    if not parts:
        empty = pa.table({c: pa.array([], pa.int64() if c == INDEX_ID else pa.string()) for c in KEY_COLUMNS})
        return LiveItems(uri, manifest, empty)
    return LiveItems(uri, manifest, pa.concat_tables(parts, promote_options="permissive"))


def _live_keys(uri: str, shard: ShardEntry) -> pa.Table:
    """A shard's live rows' KEY_COLUMNS, the repeated ones dictionary-encoded as read."""
    import pyarrow.parquet as pq

    where = _embeddings(uri, shard)
    fs, path = storage.resolve(where)

    def _read() -> pa.Table:
        with fs.open_input_file(path) as f:
            pf = pq.ParquetFile(f, read_dictionary=[CATALOGUE, ROLE])
            return pf.read(columns=[c for c in KEY_COLUMNS if c in pf.schema_arrow.names])

    table = storage.call("reading", where, _read)
    columns = {}
    for c in KEY_COLUMNS:
        values = table[c] if c in table.column_names else pa.nulls(len(table), pa.string())
        kind = pa.int64() if c == INDEX_ID else pa.string() if c == ITEM_ID else DICTIONARY
        columns[c] = values.cast(kind)
    table = pa.table(columns)
    if not shard.removed_count:
        return table
    return table.filter(pa.array(live_rows(uri, shard)))


def plan(refs: pa.Table, catalogue: str, live: LiveItems) -> Plan:
    """Compare the catalogue's references with the index's live rows (reads only stamp-changed images).

    Columnar: one hash join of the references' item ids with the live keys; the stored stamps and
    descriptions of the items found are read shard by shard and compared; Python objects only for the
    items that changed."""
    keys = live.keys
    mine = pc.equal(keys[CATALOGUE], catalogue).fill_null(False).to_numpy(zero_copy_only=False)
    row = find_rows(refs[ITEM_ID], keys[ITEM_ID])  # each reference's live row, or -1
    taken = (row >= 0) & ~mine[np.maximum(row, 0)] if len(keys) else np.zeros(len(refs), bool)
    rejects = _taken_rejects(refs, taken, keys, row, catalogue) if taken.any() else []
    if taken.any():
        refs, row = refs.filter(pa.array(~taken)), row[~taken]
    known = row >= 0
    index_ids = keys[INDEX_ID].to_numpy()
    stored = _compare(refs, index_ids, row, live)
    check = known & ~stored.same_stamp  # read + hash these, compare with the stored fingerprint
    same_bytes = stored.same_stamp.copy()
    if check.any():
        same_bytes[check] = _hash_equal(refs.filter(pa.array(check)), stored.prints)
    changed = known & ~same_bytes
    restamp = known & same_bytes & ~(stored.same_stamp & stored.same_desc)
    matched = np.zeros(len(keys), bool)
    matched[row[known]] = True
    gone = mine & ~matched
    new = ~known
    result = Plan(embed=pa.concat_tables([refs.filter(pa.array(new)), refs.filter(pa.array(changed))]),
                  new=int(new.sum()), changed=int(changed.sum()),
                  removed=index_ids[gone].astype(np.int64),
                  unchanged=int((known & same_bytes & stored.same_stamp & stored.same_desc).sum()),
                  indexed=int(mine.sum()), hashed=int(check.sum()), rejects=rejects)
    again = np.flatnonzero(changed | restamp)
    if len(again):
        ids = take_rows(refs[ITEM_ID], again).to_pylist()
        result.replaced = dict(zip(ids, index_ids[row[again]].tolist(), strict=True))
    result.restamped = _restamp_source(refs, index_ids[row[restamp]], restamp)
    log.info("catalogue %s: %d new, %d changed, %d restamped, %d removed, %d unchanged (%d image(s) read to "
             "compare)", catalogue, result.new, result.changed, result.restamp_count, len(result.removed),
             result.unchanged, result.hashed)
    return result


@dataclass
class _Stored:
    """For each reference: whether the stored stamp and description are the listed ones (False when it
    is new); and the stored fingerprints of those whose stamp differs (in order)."""

    same_stamp: np.ndarray
    same_desc: np.ndarray
    prints: list


def _compare(refs: pa.Table, index_ids: np.ndarray, row: np.ndarray, live: LiveItems) -> _Stored:
    """Read the compared columns of the known references' rows, one shard at a time, and compare."""
    n = len(refs)
    out = _Stored(np.zeros(n, bool), np.zeros(n, bool), [])
    known = np.flatnonzero(row >= 0).astype(row.dtype)  # the references found, as live rows: row[known]
    if not len(known):
        return out
    starts = np.array([s.id_start for s in live.manifest.shards], dtype=np.int64)
    shard_of = (np.searchsorted(starts, index_ids[row[known]], side="right") - 1).astype(np.int32)
    prints: dict[int, str | None] = {}
    for i, shard in enumerate(live.manifest.shards):
        mine = known[shard_of == i]  # references whose row is in this shard
        if len(mine):
            where, rows = _embeddings(live.uri, shard), index_ids[row[mine]] - shard.id_start
            differ = _compare_shard(refs, mine, read_rows(where, rows, COMPARED, missing_ok=True), out)
            if len(differ):  # the stored fingerprints of the items whose stamp changed
                old = read_rows(where, rows[differ], [FINGERPRINT], missing_ok=True)[FINGERPRINT]
                prints.update(zip(mine[differ].tolist(), old.cast(pa.string()).to_pylist(), strict=True))
    out.prints = [prints[i] for i in np.flatnonzero((row >= 0) & ~out.same_stamp)]
    return out


def _compare_shard(refs: pa.Table, rows: np.ndarray, stored: pa.Table, out: _Stored) -> np.ndarray:
    """Compare the references ``rows`` with their stored rows (in the same order); returns the positions
    (in ``rows``) of those whose stamp differs."""
    listed = take_rows(refs.select(COMPARED), rows)
    same_stamp = _equal(listed[STAMP], stored[STAMP])
    out.same_stamp[rows] = same_stamp
    out.same_desc[rows] = _same_description(listed, stored)
    return np.flatnonzero(~same_stamp)


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


def _taken_rejects(refs: pa.Table, taken: np.ndarray, keys: pa.Table, row: np.ndarray, catalogue: str
                   ) -> list[dict]:
    """A reject for each reference whose item id another catalogue has indexed (the plan leaves it out)."""
    clash = refs.filter(pa.array(taken))
    owner = take_rows(keys[CATALOGUE], row[taken]).to_pylist()
    rejects = []
    for ref, where in zip(clash.to_pylist(), owner, strict=True):
        rejects.append(Reject(item_id=ref[ITEM_ID], dataset=ref[DATASET], reason="duplicate_item_id",
                              stage="catalogue", source_path=ref["source_path"],
                              detail=f"item id already indexed from catalogue {where}").to_dict())
    log.warning("catalogue %s: %d item id(s) are indexed from other catalogues; rejected", catalogue,
                len(rejects))
    return rejects


def _equal(a: pa.ChunkedArray, b: pa.ChunkedArray) -> np.ndarray:
    """Element-wise equality of two string columns, nulls equal to nothing."""
    return pc.equal(a.cast(pa.string()), b.cast(pa.string())).fill_null(False).to_numpy(zero_copy_only=False)


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


def _hash_equal(refs: pa.Table, old: list) -> np.ndarray:
    """Read each distinct image once (not decode) and compare its sha256 with the stored fingerprint."""
    images, rows = share_images(refs)
    data = read_image_bytes(images)
    prints = [None if isinstance(d, Exception) or not d else fingerprint(bytes(d)) for d in data]
    now = [prints[i] for i in rows.tolist()]
    return np.array([p is not None and p == o for p, o in zip(now, old, strict=True)], dtype=bool)


def _restamp_source(refs: pa.Table, index_id: np.ndarray, restamp: np.ndarray) -> pa.Table:
    """Global id of each restamped item's row (``index_id``, in order), with the listing's stamp and
    description columns."""
    chosen = plain(refs.filter(pa.array(restamp)))
    return pa.table({INDEX_ID: pa.array(index_id.astype(np.int64)), ITEM_ID: chosen[ITEM_ID],
                     STAMP: chosen[STAMP], **{c: chosen[c] for c in DESCRIBED_BY}})


def _embeddings(uri: str, shard: ShardEntry) -> str:
    return IndexFolder(uri).file(shard.embeddings.path)
