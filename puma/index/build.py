"""Create, extend and rebuild a sharded index; every change commits by writing the manifest last.

Typical use (what ``jobs/embed.py`` calls)::

    create_index(uri, cfg.index, train_vectors, expected_items=n, model_id=ckpt)  # once; idempotent
    add_items(uri, embeddings_table, model_id=ckpt, source=catalogue_uri)       # per catalogue/block

or ``build_index(uri, table, cfg.index)`` for both at once. Writes are idempotent: item ids already
in the index are skipped and counted, and a shard folder left by a crashed write (absent from the
manifest) is deleted before the next write, so a re-run finishes with every item exactly once.
One writer per index at a time.
"""

from __future__ import annotations

import dataclasses
import io
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from puma import library_versions, storage
from puma.config import IndexConfig
from puma.faults import fault_point
from puma.index import backend
from puma.index.layout import (
    SHARD_EMBEDDINGS_FILE,
    SHARD_INDEX_FILE,
    TRAINED_FILE,
    IndexFolder,
    removed_file,
    shard_file,
)
from puma.index.manifest import (
    LIBRARIES,
    IndexIntegrityError,
    Manifest,
    ShardEntry,
    has_manifest,
    live_rows,
    now,
    orphan_files,
    orphan_shards,
    read_manifest,
    removed_ids,
    shard_name,
    write_file,
    write_manifest,
)
from puma.index.plan import IndexInputError, plan_index
from puma.index.table import (
    INDEX_ID,
    ITEM_ID,
    check_table,
    drop_indexed,
    embedding_dim,
    embedding_matrix,
    first_occurrences,
    read_columns,
    read_table,
    to_parquet_bytes,
)

log = logging.getLogger(__name__)


@dataclass
class AddReport:
    """What a write did: items added, duplicates skipped (already indexed or repeated), shards."""

    added: int = 0
    skipped_duplicates: int = 0
    duplicate_examples: list[str] = field(default_factory=list)
    shards: list[str] = field(default_factory=list)
    removed_orphans: list[str] = field(default_factory=list)
    total: int = 0  # items in the index after the write


def create_index(uri: str, cfg: IndexConfig, train_vectors: np.ndarray, expected_items: int | None = None,
                 model_id: str = "", checkpoint: str = "") -> Manifest:
    """Plan, train once and save trained.faiss + an empty manifest; returns the existing one if present."""
    x = _check_vectors(train_vectors, "train_vectors")  # (n, E)
    if has_manifest(uri):
        manifest = read_manifest(uri)
        check_compatible(manifest, x.shape[1], model_id, uri)
        log.info("index %s exists (%s, %d items): kept, not retrained", uri, manifest.factory, manifest.total)
        return manifest
    plan = plan_index(cfg, expected_items or len(x), x.shape[1])
    sample = _sample(x, plan.train_sample, cfg.seed)
    log.info("training %s on %d vectors of dim %d", plan.factory, len(sample), plan.dim)
    trained = backend.train_index(backend.new_index(plan), sample, cfg.use_gpu)
    entry = write_file(uri, TRAINED_FILE, backend.serialize(trained))
    manifest = Manifest(model_id=model_id, dim=plan.dim, metric=plan.metric, index_type=plan.index_type,
                        factory=plan.factory, nlist=plan.nlist, pq_m=plan.pq_m, shard_size=cfg.shard_size,
                        train_count=len(sample) if plan.index_type != "flat" else 0,
                        memory_estimate_bytes=plan.memory_bytes, trained=entry, created=now(),
                        versions=library_versions(LIBRARIES), config=dataclasses.asdict(cfg),
                        checkpoint=checkpoint)
    write_manifest(uri, manifest)
    return manifest


def build_index(uri: str, table: pa.Table | str, cfg: IndexConfig, model_id: str = "",
                source: str = "") -> AddReport:
    """create_index (trained on a sample of ``table``) then add_items; ``table`` may be a Parquet URI."""
    table = check_table(read_table(table) if isinstance(table, str) else table)
    create_index(uri, cfg, embedding_matrix(table), expected_items=len(table), model_id=model_id)
    return add_items(uri, table, model_id=model_id, source=source)


def add_shard(uri: str, table: pa.Table, model_id: str = "", source: str = "") -> AddReport:
    """Add the table's new items as ONE shard (files first, manifest last)."""
    return add_items(uri, table, model_id=model_id, source=source, shard_size=max(1, len(table)))


def add_items(uri: str, table: pa.Table | str, model_id: str = "", source: str = "",
              shard_size: int | None = None) -> AddReport:
    """Add the table's new items as shards of ``shard_size`` (default: the manifest's), one commit each."""
    table = read_table(table) if isinstance(table, str) else table
    manifest = read_manifest(uri)
    report = AddReport(removed_orphans=clean_orphans(uri, manifest), total=manifest.total)
    if len(table) == 0:
        return report
    table = check_table(table)
    check_compatible(manifest, embedding_dim(table), model_id, uri)
    table = _new_items(table, indexed_item_ids(uri, manifest), report)
    size = shard_size or manifest.shard_size
    for start in range(0, len(table), size):
        done = commit_changes(uri, table.slice(start, size), source=source, shard_size=size)
        report.shards += done.shards
        report.added += done.added
        report.total = done.total
    return report


def _new_items(table: pa.Table, indexed: pa.Array, report: AddReport) -> pa.Table:
    """Drop rows already indexed or repeated within the table, counting them in ``report``."""
    table, repeated, examples = first_occurrences(table)
    table, known, known_examples = drop_indexed(table, indexed)
    report.skipped_duplicates = repeated + known
    report.duplicate_examples = (known_examples + examples)[:10]
    if report.skipped_duplicates:
        log.info("skipped %d duplicate item id(s), e.g. %s", report.skipped_duplicates,
                 report.duplicate_examples)
    return table


@dataclass
class CommitReport:
    """What one commit did: rows added as new shards, ids removed, shards dropped, the index after."""

    added: int = 0
    removed: int = 0
    shards: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    total: int = 0
    manifest: Manifest | None = None


def commit_changes(uri: str, table: pa.Table | None = None, remove: np.ndarray | None = None, *,
                   source: str = "", shard_size: int | None = None, drop: tuple[str, ...] = (),
                   update: Callable[[Manifest], None] | None = None) -> CommitReport:
    """ONE commit (one manifest write) of: the table's rows as new shards, the removal of the global
    ids ``remove`` (tombstones; ids not live are ignored), the dropping of the shards named in ``drop``
    and ``update(manifest)`` (catalogue and run records). Files first, manifest last: a crash before
    the manifest write leaves the index as it was, plus files the next write deletes."""
    manifest = read_manifest(uri)
    clean_orphans(uri, manifest)  # what a crashed or superseded write left
    before = _state_key(manifest)
    report = CommitReport()
    added = []
    if table is not None and len(table):
        added = _write_new_shards(uri, manifest, table, source, shard_size)
    tombstoned, report.removed = _write_tombstones(uri, manifest, remove)
    shards = [tombstoned.get(s.name, s) for s in manifest.shards if s.name not in drop]
    _check_no_other_writer(uri, before)
    manifest.shards = shards + added
    if added:
        manifest.next_free_id = added[-1].id_end
        manifest.next_shard = int(added[-1].name.rsplit("-", 1)[-1]) + 1
    if update is not None:
        update(manifest)
    fault_point("index.commit")
    write_manifest(uri, manifest)
    report.added, report.shards = sum(e.count for e in added), [e.name for e in added]
    report.dropped, report.total, report.manifest = list(drop), manifest.total, manifest
    return report


def _write_new_shards(uri: str, manifest: Manifest, table: pa.Table, source: str,
                      shard_size: int | None) -> list[ShardEntry]:
    """The table's rows as shards of ``shard_size`` after the manifest's last id (files only, no commit)."""
    table = check_table(table)
    check_compatible(manifest, embedding_dim(table), "", uri)
    trained = _read_trained(uri, manifest)
    size = shard_size or manifest.shard_size
    seq = int(manifest.next_shard_name.rsplit("-", 1)[-1])
    next_id, entries = manifest.next_id, []
    for start in range(0, len(table), size):
        entry = _write_shard(uri, shard_name(seq), next_id, trained, table.slice(start, size), source)
        entries.append(entry)
        seq, next_id = seq + 1, entry.id_end
    return entries


def _write_shard(uri: str, name: str, id_start: int, trained: bytes, table: pa.Table,
                 source: str) -> ShardEntry:
    """One shard's Parquet and index files with global ids from ``id_start`` (not committed)."""
    ids = np.arange(id_start, id_start + len(table), dtype=np.int64)  # global ids
    table = table.add_column(0, INDEX_ID, pa.array(ids))
    index = backend.deserialize(trained)
    index.add_with_ids(embedding_matrix(table), ids)
    embeddings = write_file(uri, shard_file(name, SHARD_EMBEDDINGS_FILE), to_parquet_bytes(table))
    fault_point("index.shard_written")
    index_entry = write_file(uri, shard_file(name, SHARD_INDEX_FILE), backend.serialize(index))
    return ShardEntry(name=name, count=len(table), id_start=id_start, index=index_entry,
                      embeddings=embeddings, created=now(), source=source)


def _write_tombstones(uri: str, manifest: Manifest,
                      remove: np.ndarray | None) -> tuple[dict[str, ShardEntry], int]:
    """A new removed-ids file for every shard that loses live ids; (name -> new entry, ids removed)."""
    remove = np.unique(np.asarray(remove if remove is not None else [], dtype=np.int64))
    if not len(remove) or not manifest.shards:
        return {}, 0
    starts = np.array([s.id_start for s in manifest.shards], dtype=np.int64)
    shard_of = np.searchsorted(starts, remove, side="right") - 1
    changed, count = {}, 0
    for i in np.unique(shard_of[shard_of >= 0]):
        entry = manifest.shards[i]
        ids = remove[(shard_of == i) & (remove < entry.id_end)]
        old = removed_ids(uri, entry)
        new = np.union1d(old, ids).astype(np.int64)
        if len(new) == len(old):
            continue
        buf = io.BytesIO()
        np.save(buf, new, allow_pickle=False)
        data = buf.getvalue()
        path = shard_file(entry.name, removed_file(storage.sha256(data)))
        changed[entry.name] = dataclasses.replace(entry, removed=write_file(uri, path, data),
                                                  removed_count=len(new))
        count += len(new) - len(old)
    return changed, count


def compact(uri: str, min_fraction: float) -> CommitReport:
    """Rewrite the live rows of every shard whose removed rows reach ``min_fraction`` of it as new
    shards, dropping the old ones, in one commit (crash-safe: the old shards stay committed until
    the manifest names the new ones; their folders are deleted by the next write)."""
    manifest = read_manifest(uri)
    worn = [s for s in manifest.shards if s.removed_count and s.removed_count >= min_fraction * s.count]
    if not worn:
        return CommitReport(total=manifest.total, manifest=manifest)
    parts = [_live_rows(uri, s) for s in worn]
    live = pa.concat_tables(parts, promote_options="permissive") if parts else None
    log.info("compacting %d shard(s) of %s: %d live row(s) kept, %d removed row(s) dropped", len(worn), uri,
             sum(s.live for s in worn), sum(s.removed_count for s in worn))
    return commit_changes(uri, live, source="compaction", drop=tuple(s.name for s in worn))


def live_table(uri: str) -> pa.Table:
    """Every live row of the committed shards (removed rows left out), all stored columns but index_id."""
    manifest = read_manifest(uri)
    parts = [_live_rows(uri, s) for s in manifest.shards]
    if not parts:
        raise IndexInputError(f"index {uri} has no items yet")
    return pa.concat_tables(parts, promote_options="permissive")


def _live_rows(uri: str, shard: ShardEntry) -> pa.Table:
    """A shard's stored rows less its removed ones, without index_id (ready to be written again)."""
    table = read_table(IndexFolder(uri).file(shard.embeddings.path))
    return table.filter(pa.array(live_rows(uri, shard))).drop_columns([INDEX_ID])


def _state_key(manifest: Manifest) -> tuple:
    """What changes with every commit: the shards with their removals."""
    return tuple((s.name, s.index.sha256, s.removed.sha256 if s.removed else "") for s in manifest.shards)


def _check_no_other_writer(uri: str, before: tuple) -> None:
    if _state_key(read_manifest(uri)) != before:
        raise IndexIntegrityError(f"index {uri} was changed by another writer during this write; run one "
                                  f"writer per index (the next run converges)")


def _read_trained(uri: str, manifest: Manifest) -> bytes:
    """trained.faiss bytes, checked against the manifest's checksum."""
    path = IndexFolder(uri).trained
    data = storage.read_bytes(path)
    if storage.sha256(data) != manifest.trained.sha256:
        raise IndexIntegrityError(f"{path} does not match the checksum in the manifest; the trained "
                                  f"index was modified: rebuild the index")
    return data


def indexed_item_ids(uri: str, manifest: Manifest | None = None) -> pa.Array:
    """Every live item id in the committed shards, in global id order (what a re-run must skip)."""
    manifest = manifest or read_manifest(uri)
    parts = [_live_column(uri, s, ITEM_ID) for s in manifest.shards]
    if not parts:
        return pa.array([], type=pa.string())
    return pa.chunked_array([c for p in parts for c in p.chunks], type=parts[0].type).combine_chunks()


def _live_column(uri: str, shard: ShardEntry, column: str) -> pa.ChunkedArray:
    col = read_columns(IndexFolder(uri).file(shard.embeddings.path), [column])[column]
    if not shard.removed_count:
        return col
    return col.filter(pa.array(live_rows(uri, shard)))


def clean_orphans(uri: str, manifest: Manifest | None = None) -> list[str]:
    """Delete shard folders the manifest does not list (left by crashed writes or compaction) and
    superseded removed-ids files; returns them."""
    manifest = manifest or read_manifest(uri)
    orphans = orphan_shards(uri, manifest) + orphan_files(uri, manifest)
    for orphan in orphans:
        log.info("removing %s: not in the manifest (an unfinished write, a compacted shard or a superseded "
                 "removed-ids file)", orphan)
        storage.delete(orphan)
    return orphans


def rebuild(src_uri: str, dst_uri: str, cfg: IndexConfig) -> AddReport:
    """A new index at ``dst_uri`` from the stored embeddings of ``src_uri`` (e.g. another type)."""
    manifest = read_manifest(src_uri)
    if not manifest.shards:
        raise IndexInputError(f"index {src_uri} has no items to rebuild from")
    table = live_table(src_uri)
    return build_index(dst_uri, table, cfg, model_id=manifest.model_id, source=f"rebuild of {src_uri}")


def check_compatible(manifest: Manifest, dim: int, model_id: str, uri: str) -> None:
    """Raise when embeddings of this dim / model cannot join the index."""
    if dim != manifest.dim:
        raise IndexInputError(f"embeddings have dimension {dim} but index {uri} has {manifest.dim}")
    if model_id and manifest.model_id and model_id != manifest.model_id:
        raise IndexInputError(f"embeddings from model {model_id!r} cannot join index {uri} built from "
                              f"{manifest.model_id!r}; build a new index for the new model")


def _check_vectors(x: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 1 or not np.issubdtype(x.dtype, np.floating):
        raise IndexInputError(f"{name} must be a non-empty float (n, E) array, got {x.dtype} {x.shape}")
    if not np.isfinite(x).all():
        raise IndexInputError(f"{name} has NaN or Inf values")
    return np.ascontiguousarray(x, dtype=np.float32)


def _sample(x: np.ndarray, n: int, seed: int) -> np.ndarray:
    """n rows of x drawn without replacement (all of x when n is 0 or >= len(x))."""
    if n <= 0 or n >= len(x):
        return x
    rows = np.sort(np.random.default_rng(seed).choice(len(x), size=n, replace=False))
    return x[rows]

