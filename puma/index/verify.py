"""verify(uri): every file the manifest lists exists with its size and sha256, and the counts agree.

Checks: trained.faiss and each shard's files (size, sha256), its removed-ids file too; per shard,
Parquet rows == index vectors == manifest count, index_id == [id_start, id_start + count), shards
in increasing id order (a compaction leaves a gap, never an overlap); live item ids (removed rows
left out) unique across the index. Shard folders absent from the manifest are listed as orphans
(an unfinished write; not an error, the next write removes them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from puma import storage
from puma.index import backend
from puma.index.layout import IndexFolder
from puma.index.manifest import (
    FileEntry,
    IndexIntegrityError,
    Manifest,
    ShardEntry,
    file_sha256,
    live_rows,
    orphan_shards,
    read_manifest,
)
from puma.index.table import INDEX_ID, ITEM_ID, read_columns


@dataclass
class VerifyReport:
    """What verify found; ``ok`` when ``problems`` is empty."""

    uri: str
    shards: int = 0
    items: int = 0
    files_checked: int = 0
    problems: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_bad(self) -> VerifyReport:
        """Raise IndexIntegrityError listing every problem; returns self when ok."""
        if self.problems:
            raise IndexIntegrityError(f"index {self.uri} failed verification ({len(self.problems)} "
                                      f"problem(s)): " + "; ".join(self.problems))
        return self


def verify(uri: str) -> VerifyReport:
    """Check checksums, sizes and counts of the index at ``uri`` against its manifest (for a location
    with versions, verify ``puma.index.versions.resolve(location)``)."""
    manifest = read_manifest(uri)
    report = VerifyReport(uri=uri, shards=len(manifest.shards), items=manifest.total)
    _check_file(uri, manifest.trained, report)
    item_ids = []
    next_start = 0
    for shard in manifest.shards:
        if shard.id_start < next_start:
            report.problems.append(f"{shard.name}: id_start {shard.id_start} overlaps the shard before "
                                   f"(ids up to {next_start - 1})")
        next_start = shard.id_start + shard.count
        removed_ok = shard.removed is None or _check_file(uri, shard.removed, report)
        files_ok = _check_file(uri, shard.index, report) and _check_file(uri, shard.embeddings, report)
        if files_ok and removed_ok:
            item_ids.append(_live(uri, shard, _check_shard(uri, manifest, shard, report), report))
    _check_unique(item_ids, report)
    report.orphans = orphan_shards(uri, manifest)
    return report


def _check_file(uri: str, entry: FileEntry, report: VerifyReport) -> bool:
    """Size and sha256 of one file; False (and a problem) when it is missing or differs."""
    path = IndexFolder(uri).file(entry.path)
    report.files_checked += 1
    if not storage.exists(path):
        report.problems.append(f"{entry.path}: missing")
        return False
    data_sha = file_sha256(path)
    if data_sha != entry.sha256:
        report.problems.append(f"{entry.path}: sha256 {data_sha[:12]}... != manifest {entry.sha256[:12]}...")
        return False
    return True


def _check_shard(uri: str, manifest: Manifest, shard: ShardEntry, report: VerifyReport) -> pa.ChunkedArray:
    """Counts and ids of one shard whose files match their checksums; returns its item ids."""
    table = read_columns(IndexFolder(uri).file(shard.embeddings.path), [INDEX_ID, ITEM_ID])
    expected = np.arange(shard.id_start, shard.id_start + shard.count, dtype=np.int64)
    ids = table[INDEX_ID].to_numpy()
    if len(table) != shard.count or not np.array_equal(ids, expected):
        report.problems.append(f"{shard.name}: Parquet has {len(table)} rows with index_id "
                               f"{ids[:1]}..{ids[-1:]}; manifest says {shard.count} from {shard.id_start}")
    index = backend.deserialize(storage.read_bytes(IndexFolder(uri).file(shard.index.path)))
    if index.ntotal != shard.count or index.d != manifest.dim:
        report.problems.append(f"{shard.name}: index holds {index.ntotal} vectors of dim {index.d}; "
                               f"manifest says {shard.count} of dim {manifest.dim}")
    return table[ITEM_ID]


def _live(uri: str, shard: ShardEntry, item_ids: pa.ChunkedArray, report: VerifyReport) -> pa.ChunkedArray:
    """The shard's item ids less its removed rows."""
    if len(item_ids) != shard.count:  # already a problem: compare what can be compared
        return item_ids
    try:
        return item_ids.filter(pa.array(live_rows(uri, shard)))
    except IndexIntegrityError as exc:
        report.problems.append(str(exc))
        return item_ids


def _check_unique(item_ids: list[pa.ChunkedArray], report: VerifyReport) -> None:
    chunks = [c for part in item_ids for c in part.chunks]
    if not chunks:
        return
    all_ids = pa.chunked_array(chunks)
    repeated = len(all_ids) - len(pc.unique(all_ids))
    if repeated:
        report.problems.append(f"{repeated} item id(s) appear more than once across shards")

