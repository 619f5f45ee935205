"""A run's writes to its index: a commit every embed.commit_rows items, then the final commit and compaction.

    -> a commit every embed.commit_rows items (puma.index.commit_changes: shard files first, manifest
       last; a changed item's old row is removed in the same commit)
    -> final commit: restamped rows, removals of items gone from the catalogue, the run's record
    -> compaction of shards whose removed rows reach index.compact_fraction (its own commit)

A crash loses at most the uncommitted block; the next run plans again from what is committed and
converges. A new flat index is created with the first commit (an IVF index is trained first: see
puma.inference.running); the first version of a location goes live at its creation.
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa

from puma.faults import fault_point
from puma.index import create_index, read_manifest
from puma.index.build import commit_changes, compact
from puma.index.manifest import Manifest, has_manifest, now
from puma.index.table import ITEM_ID, embedding_matrix
from puma.index.versions import promote, read_alias
from puma.inference.catalogue import catalogue_name
from puma.inference.embedder import to_table
from puma.inference.reconcile import restamped_rows
from puma.inference.run import Run

log = logging.getLogger(__name__)


def commit_stream(run: Run, batches) -> None:
    """Commit the stream to the index every embed.commit_rows items (and the remainder at the end)."""
    pending: list[pa.Table] = []
    count = 0
    for batch in batches:
        table = batch if isinstance(batch, pa.Table) else to_table(batch)
        if len(table):
            pending.append(table)
            count += len(table)
        if count >= run.cfg.embed.commit_rows:
            _commit(run, pa.concat_tables(pending))
            pending, count = [], 0
    if count:
        _commit(run, pa.concat_tables(pending))


def _commit(run: Run, table: pa.Table) -> None:
    """One atomic write: shard files, removal of the changed items' old rows, then the manifest
    (creating a flat index on first use)."""
    if not has_manifest(run.index_uri):
        new_index(run, embedding_matrix(table), run.cfg.embed.expected_items or len(table))
    replaced = run.plan.replaced if run.plan is not None else {}
    old = [replaced.pop(i) for i in table[ITEM_ID].to_pylist() if i in replaced]
    done = commit_changes(run.index_uri, table, remove=np.array(old, dtype=np.int64), source=run.catalogue)
    run.report.embedded += done.added
    run.report.changed += len(old)
    run.report.added += done.added - len(old)
    run.report.shards_added += done.shards
    run.report.total = done.total
    log.info("committed %d item(s) as %s (%d replacing changed ones; index total %d)", done.added,
             done.shards, len(old), done.total)
    fault_point("embed.block")


def new_index(run: Run, train_vectors: np.ndarray, expected: int) -> None:
    """Create the index this run writes; the first version of a location is live from its creation
    (there is no other to keep serving), so readers see it grow as it commits."""
    create_index(run.index_uri, run.cfg.index, train_vectors, expected_items=expected, model_id=run.model_id,
                 checkpoint=run.checkpoint)
    if run.report.version and read_alias(run.report.location) is None:
        promote(run.report.location, run.report.version)
        run.report.promoted = run.report.version


def final_commit(run: Run) -> None:
    """Restamped rows, removals (items gone, changed items whose new image was rejected) and the run's
    record in one commit; then compaction when removed rows pass index.compact_fraction of a shard."""
    p = run.plan
    manifest = read_manifest(run.index_uri)
    restamped = restamped_rows(run.index_uri, manifest, p) if p is not None else None
    leftover = list(p.replaced.values()) if p is not None else []  # restamped, or changed but now rejected
    gone = p.removed if p is not None else np.zeros(0, np.int64)
    remove = np.concatenate([gone, np.array(leftover, dtype=np.int64)])
    run.report.restamped = 0 if restamped is None else len(restamped)
    run.report.removed = len(gone) + len(leftover) - run.report.restamped
    record = run.report.record()
    items = (p.indexed if p is not None else 0) + run.report.added - run.report.removed

    def update(m: Manifest) -> None:
        m.catalogues[run.catalogue] = {"name": catalogue_name(run.catalogue), "items": items,
                                       "updated": now()}
        m.checkpoint = m.checkpoint or run.checkpoint
        m.record_run(record)

    done = commit_changes(run.index_uri, restamped, remove=remove, source=run.catalogue, update=update)
    run.report.shards_added += done.shards
    compacted = compact(run.index_uri, run.cfg.index.compact_fraction)
    run.report.compacted = compacted.dropped
    run.report.total = compacted.total or done.total
