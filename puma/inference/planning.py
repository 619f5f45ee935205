"""What one run reads and embeds: the reconcile plan of its split, less listed rejects, as distinct images.

    catalogue references (puma.inference.catalogue)        listed on the driver, no bytes read
      x the index's live rows (puma.inference.reconcile)    new / changed / restamped / removed
      - listed rejects (puma.inference.rejects)             dropped BEFORE any read or decode
      -> distinct images (SharedImages)                     each (image_uri, image_row) read once

Rows sharing a photo (product variants) get its embedding and fingerprint with their own item id,
description and stamp, in the same commit, or are rejected with it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from puma.data import schema
from puma.data.columns import take_rows
from puma.data.rejects import Reject
from puma.data.tables import is_table
from puma.index import read_manifest
from puma.index.build import check_compatible
from puma.index.manifest import has_manifest
from puma.index.table import CATALOGUE, DATASET, ITEM_ID, ROLE, STAMP
from puma.inference.catalogue import check_unique, is_prepared, list_catalogue, plain
from puma.inference.embedder import (
    EMBEDDING,
    FINGERPRINT,
    META_COLUMNS,
    OUTPUT_COLUMNS,
    share_images,
    to_table,
)
from puma.inference.reconcile import LiveItems, live_items, plan
from puma.inference.rejects import add_rejects, list_prepare_rejects, skip_listed
from puma.inference.run import Run

log = logging.getLogger(__name__)


def what_to_embed(run: Run, split: str) -> pa.Table:
    """What to read and embed: the plan's new and changed items, less what earlier runs rejected."""
    listing = list_catalogue(run.catalogue, split, run.cfg.embed.stamp_column)
    refs = listing.refs
    if not is_table(run.catalogue):  # a table's repeated ids are rejects already
        check_unique(refs, run.catalogue)
    list_prepare_rejects(run.report.rejects_uri, run.catalogue, split)
    run.report.items, run.report.ignored_files = len(refs), listing.ignored
    manifest = read_manifest(run.index_uri) if has_manifest(run.index_uri) else None
    if manifest is not None:
        check_compatible(manifest, manifest.dim, run.model_id, run.index_uri)  # refuse another model early
    live = live_items(run.index_uri, manifest)
    run.plan = plan(refs, run.catalogue, _in_split(live, run.catalogue, split))
    add_rejects(run.report.rejects_uri, listing.rejects + run.plan.rejects)
    run.report.read_to_compare = run.plan.hashed
    run.report.skipped_indexed = run.plan.unchanged + run.plan.restamp_count
    todo = run.plan.embed
    if not run.cfg.embed.retry_rejects:
        todo, run.report.skipped_rejected = skip_listed(run.report.rejects_uri, todo, run.plan.replaced,
                                                        run.catalogue)
    log.info("catalogue %s: %d item(s), %d to embed", run.catalogue, run.report.items, len(todo))
    return todo


def _in_split(live: LiveItems, catalogue: str, split: str) -> LiveItems:
    """The live rows a run over ``split`` of a prepared catalogue answers for: another split's items
    are not removed because this run did not list them."""
    if split == "all" or not is_prepared(catalogue):
        return live
    roles = {"train": [schema.ROLE_TRAIN], "test": [schema.QUERY, schema.GALLERY]}[split]
    keys = live.keys
    mine = pc.equal(keys[CATALOGUE], catalogue).fill_null(False)
    other_split = pc.and_(mine, pc.invert(pc.is_in(keys[ROLE], value_set=pa.array(roles, pa.string()))))
    return live.where(pc.invert(other_split.fill_null(False)))


@dataclass
class SharedImages:
    """The rows to embed as distinct images: one reference per image (image_uri, image_row) is read,
    decoded and embedded; the rows sharing it (product variants with one photo) get its embedding and
    fingerprint with their own item id, description and stamp, in the same commit."""

    images: pa.Table  # one reference per distinct image (its first row)
    sharers: pa.Table  # every other row, plain columns
    image_of: np.ndarray  # (len(sharers),) the position in ``images`` of each sharer's image
    sharers_of: dict[str, np.ndarray]  # item id of a shared image's reference -> its sharers' rows
    embedded: set = field(default_factory=set)  # references of shared images that were embedded

    @classmethod
    def of(cls, todo: pa.Table) -> SharedImages:
        images, position = share_images(todo)
        first = np.zeros(len(todo), bool)
        first[np.unique(position, return_index=True)[1]] = True
        if first.all():
            return cls(images, todo.slice(0, 0), np.zeros(0, np.int64), {})
        rows = np.flatnonzero(~first)
        sharers, image_of = plain(take_rows(todo, rows)), position[rows]
        order = np.argsort(image_of, kind="stable")
        bounds = np.flatnonzero(np.diff(image_of[order], prepend=-1, append=-2))
        owners = images[ITEM_ID].take(pa.array(image_of[order[bounds[:-1]]])).to_pylist()
        groups = {item: order[a:b] for item, a, b in zip(owners, bounds[:-1], bounds[1:], strict=True)}
        return cls(images, sharers, image_of, groups)

    def rows(self, run: Run, batches: Iterator) -> Iterator[pa.Table]:
        """Each embedded batch as a table, followed by the rows sharing its images; counts the images."""
        for batch in batches:
            table = batch if isinstance(batch, pa.Table) else to_table(batch)
            run.report.images += len(table)
            if self.sharers_of:
                table = pa.concat_tables([table, self._sharing(table)])
            yield table

    def _sharing(self, table: pa.Table) -> pa.Table:
        """The sharers of the batch's images, with their image's embedding and fingerprint."""
        ids = table[ITEM_ID].to_pylist()
        found = [(i, self.sharers_of[item]) for i, item in enumerate(ids) if item in self.sharers_of]
        self.embedded.update(ids[i] for i, _ in found)
        if not found:
            return table.slice(0, 0)
        rows = np.concatenate([r for _, r in found])
        source = np.concatenate([np.full(len(r), i, np.int64) for i, r in found])  # each one's image row
        own = self.sharers.take(pa.array(rows))
        columns = {c: own[c] for c in META_COLUMNS if c != FINGERPRINT}
        columns.update({c: table[c].take(pa.array(source)) for c in (EMBEDDING, FINGERPRINT)})
        return pa.table({c: columns[c].cast(table.schema.field(c).type) for c in OUTPUT_COLUMNS})

    def rejects(self, rejected: list[dict]) -> list[dict]:
        """A reject for every row sharing an image whose reference was rejected (its reason, its stage)."""
        by_item = {r["item_id"]: r for r in rejected}
        out = []
        for item, rows in self.sharers_of.items():
            if item in self.embedded or item not in by_item:
                continue
            first = by_item[item]
            for r in self.sharers.take(pa.array(rows)).to_pylist():
                detail = f"{first.get('detail', '')} (the image of item {item!r}, read once for every row)"
                out.append(Reject(item_id=r[ITEM_ID], dataset=r[DATASET], reason=first["reason"],
                                  stage=first["stage"], source_path=r[schema.SOURCE_PATH],
                                  split=r[schema.SPLIT], detail=detail, stamp=r[STAMP]).to_dict())
        return out
