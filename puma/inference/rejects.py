"""A catalogue's rejects file: where it is, what joins it, and which listed items a run skips.

``<index.uri>/rejects/<catalogue name>.jsonl`` (puma.data.rejects format; reasons corrupt, truncated,
tiny, too_large, missing_file, empty_file, and a table's empty_item_id, missing_image_uri,
duplicate_item_id) lists what a run could not index: the listing's and the plan's rejects, a prepared
catalogue's prepare-time rejects of the embedded splits, and every image that failed to read or decode
(in this process, or collected from the Ray Data decode tasks by a RejectLog actor). Listed new items
are not re-tried by later runs unless embed.retry_rejects is set; a changed item is always read again,
and so is a rejected image whose stamp has changed since (a fixed photo).
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from puma.data.columns import take_rows
from puma.data.manifest import load_manifest
from puma.data.rejects import read_rejects, write_rejects
from puma.index.layout import IndexLocation
from puma.index.table import ITEM_ID, STAMP
from puma.inference.catalogue import SPLITS, catalogue_name, is_prepared, without

log = logging.getLogger(__name__)


def rejects_uri(index_uri: str, catalogue: str) -> str:
    """Where a catalogue's rejects are listed (puma.index.layout)."""
    return IndexLocation(index_uri).rejects(catalogue_name(catalogue))


def add_rejects(uri: str, rows: list[dict]) -> None:
    """List ``rows`` (the listing's, the plan's, a decode's) in the rejects file ``uri`` (first row kept)."""
    if rows:
        write_rejects(uri, [*read_rejects(uri), *rows])


def list_prepare_rejects(uri: str, catalogue: str, split: str) -> None:
    """A prepared catalogue's prepare-time rejects of the embedded splits join the rejects file ``uri``."""
    if not is_prepared(catalogue):
        return
    splits = SPLITS[split]
    found = [r for r in read_rejects(load_manifest(catalogue).rejects_uri)
             if r.get("split") in splits or split == "all"]
    if found:  # rows already listed keep their place (dumps keeps the first row of an item id)
        write_rejects(uri, [*read_rejects(uri), *found])


def skip_listed(uri: str, todo: pa.Table, replaced: dict, catalogue: str) -> tuple[pa.Table, int]:
    """``todo`` less the new items whose image the rejects file ``uri`` lists, and how many were left out.
    Changed items (``replaced``: item id -> its live row) are always read again."""
    fixed = _forget_fixed(uri, todo, catalogue)
    rows = read_rejects(uri)
    bad_images = [r["item_id"] for r in rows if r.get("stage") != "catalogue" and r["item_id"] not in fixed]
    listed = pa.array(bad_images, pa.string())  # a catalogue-stage reject names a row, not the item
    fresh = pc.invert(pc.is_in(todo[ITEM_ID], value_set=pa.array(list(replaced), pa.string())))
    retried = todo.filter(pc.invert(fresh))  # changed items are always read again
    kept, skipped = without(todo.filter(fresh), listed)
    return pa.concat_tables([kept, retried]), skipped


def _forget_fixed(uri: str, todo: pa.Table, catalogue: str) -> set[str]:
    """Items rejected earlier whose image has changed since (another stamp): their old rows leave the
    rejects file and they are read again (a fixed photo is indexed without embed.retry_rejects)."""
    rows = read_rejects(uri)
    stamped = [r for r in rows if r.get("stamp")]
    at = pc.index_in(pa.array([r["item_id"] for r in stamped], pa.string()), value_set=todo[ITEM_ID])
    at = at.fill_null(-1).to_numpy(zero_copy_only=False)  # each one's row in todo, or -1
    listed = np.flatnonzero(at >= 0)
    now = dict(zip(listed.tolist(), take_rows(todo[STAMP], at[listed]).to_pylist(), strict=True))
    fixed = {r["item_id"] for i, r in enumerate(stamped) if i in now and now[i] != r["stamp"]}
    if fixed:
        write_rejects(uri, [r for r in rows if r["item_id"] not in fixed])
        log.info("catalogue %s: %d rejected image(s) changed since: read again", catalogue, len(fixed))
    return fixed


def reject_log(uri: str):
    """The RejectLog actor of the rejects file ``uri``, seeded with what earlier runs listed: the Ray Data
    decode tasks record their rejects with it."""
    from puma.data.reject_log import start_reject_log

    return start_reject_log("puma-embed-rejects-", uri, read_rejects(uri))
