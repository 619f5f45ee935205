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
import logging
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from puma import library_versions, storage
from puma.config import IndexConfig
from puma.index import backend
from puma.index.manifest import (
    LIBRARIES,
    SHARD_EMBEDDINGS_FILE,
    SHARD_INDEX_FILE,
    SHARDS_DIR,
    TRAINED_FILE,
    IndexIntegrityError,
    Manifest,
    ShardEntry,
    has_manifest,
    now,
    orphan_shards,
    read_manifest,
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
                 model_id: str = "") -> Manifest:
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
                        versions=library_versions(LIBRARIES), config=dataclasses.asdict(cfg))
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
    trained = _read_trained(uri, manifest)
    size = shard_size or manifest.shard_size
    for start in range(0, len(table), size):
        entry = _commit_shard(uri, manifest, trained, table.slice(start, size), source)
        report.shards.append(entry.name)
        report.added += entry.count
    report.total = manifest.total
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


def _commit_shard(uri: str, manifest: Manifest, trained: bytes, table: pa.Table, source: str) -> ShardEntry:
    """Write one shard's Parquet and index, then append it to the manifest (the commit)."""
    name = shard_name(len(manifest.shards))
    ids = np.arange(manifest.next_id, manifest.next_id + len(table), dtype=np.int64)  # global ids
    table = table.add_column(0, INDEX_ID, pa.array(ids))
    index = backend.deserialize(trained)
    index.add_with_ids(embedding_matrix(table), ids)
    folder = f"{SHARDS_DIR}/{name}"
    embeddings = write_file(uri, f"{folder}/{SHARD_EMBEDDINGS_FILE}", to_parquet_bytes(table))
    index_entry = write_file(uri, f"{folder}/{SHARD_INDEX_FILE}", backend.serialize(index))
    entry = ShardEntry(name=name, count=len(table), id_start=int(ids[0]), index=index_entry,
                       embeddings=embeddings, created=now(), source=source)
    _check_no_other_writer(uri, manifest)
    manifest.shards.append(entry)
    try:
        write_manifest(uri, manifest)
    except BaseException:
        manifest.shards.pop()  # not committed: keep the caller's manifest as it is on storage
        raise
    return entry


def _check_no_other_writer(uri: str, manifest: Manifest) -> None:
    committed = len(read_manifest(uri).shards)
    if committed != len(manifest.shards):
        raise IndexIntegrityError(f"index {uri} gained {committed - len(manifest.shards)} shard(s) from "
                                  f"another writer during this write; run one writer per index")


def _read_trained(uri: str, manifest: Manifest) -> bytes:
    """trained.faiss bytes, checked against the manifest's checksum."""
    path = storage.join(uri, TRAINED_FILE)
    data = storage.read_bytes(path)
    if storage.sha256(data) != manifest.trained.sha256:
        raise IndexIntegrityError(f"{path} does not match the checksum in the manifest; the trained "
                                  f"index was modified: rebuild the index")
    return data


def indexed_item_ids(uri: str, manifest: Manifest | None = None) -> pa.Array:
    """Every item id in the committed shards, in global id order (what a re-run must skip)."""
    manifest = manifest or read_manifest(uri)
    parts = [read_columns(storage.join(uri, *s.embeddings.path.split("/")), [ITEM_ID])[ITEM_ID]
             for s in manifest.shards]
    if not parts:
        return pa.array([], type=pa.string())
    return pa.chunked_array([c for p in parts for c in p.chunks], type=parts[0].type).combine_chunks()


def clean_orphans(uri: str, manifest: Manifest | None = None) -> list[str]:
    """Delete shard folders the manifest does not list (left by crashed writes); returns them."""
    orphans = orphan_shards(uri, manifest or read_manifest(uri))
    for orphan in orphans:
        log.warning("removing unfinished shard %s (not in the manifest)", orphan)
        storage.delete(orphan)
    return orphans


def rebuild(src_uri: str, dst_uri: str, cfg: IndexConfig) -> AddReport:
    """A new index at ``dst_uri`` from the stored embeddings of ``src_uri`` (e.g. another type)."""
    manifest = read_manifest(src_uri)
    tables = [read_table(storage.join(src_uri, *s.embeddings.path.split("/"))).drop_columns([INDEX_ID])
              for s in manifest.shards]
    if not tables:
        raise IndexInputError(f"index {src_uri} has no items to rebuild from")
    table = pa.concat_tables(tables, promote_options="permissive")
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

