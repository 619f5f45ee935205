"""The index manifest: what an index folder holds, written last so that it is the commit point.

What an index folder holds (its paths are named in ``puma.index.layout``)::

    manifest.json                   this file: model id, dim, metric, type, factory, shards,
                                    checksums of every other file, created/updated, versions,
                                    the catalogues it holds and what the last runs changed
    trained.faiss                   the trained, empty index shared by every shard
    shards/shard-00000/index.faiss  trained.faiss + this shard's vectors (ids = global int64 ids)
    shards/shard-00000/embeddings.parquet
                                    index_id, item_id, embedding float32[E], dataset, label, ...
    shards/shard-00000/removed-<sha256[:16]>.npy
                                    the shard's removed global ids (sorted int64), when it has any

Each shard's global ids are contiguous: shard i holds ids [id_start, id_start + count) in Parquet
row order, so id -> item_id is a row lookup; shards are listed in id order and ids are never
reused (``next_id`` only grows), so a compacted shard leaves a gap. A removal is a tombstone: the
shard's ``removed`` file lists the ids that search must never return (they are taken out of the
FAISS shard as it is loaded), until compaction (``puma.index.reconcile``) rewrites the shard's
live rows as a new shard. A shard folder absent from the manifest is an unfinished write (or a
compacted shard): search ignores it and the next write deletes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import time
from dataclasses import dataclass, field

import numpy as np

from puma import storage
from puma.errors import UserError
from puma.index.layout import MANIFEST_FILE, IndexFolder, folder_name, shard_file
from puma.index.plan import IndexInputError

FORMAT_VERSION = 2  # 2: tombstones (removed), catalogues, runs, checkpoint, next_free_id
RUNS_KEPT = 50  # run records a manifest keeps (the newest)
# the libraries that shape an index's meaning (manifest "versions", evaluation.json "versions")
LIBRARIES = ("faiss-cpu", "faiss-gpu", "faiss-gpu-cu12", "numpy", "pyarrow", "puma-ray")


class IndexIntegrityError(UserError, ValueError):
    """An index folder whose files, checksums or counts disagree with its manifest."""


@dataclass
class FileEntry:
    """One file of the index, relative to the index folder, with its size and sha256."""

    path: str
    sha256: str
    bytes: int


@dataclass
class ShardEntry:
    """One committed shard: ``count`` items with global ids [id_start, id_start + count)."""

    name: str
    count: int
    id_start: int
    index: FileEntry
    embeddings: FileEntry
    created: str
    source: str = ""  # free text from the writer, e.g. the catalogue URI
    removed: FileEntry | None = None  # the shard's removed (tombstoned) global ids, sorted int64 .npy
    removed_count: int = 0

    @property
    def live(self) -> int:
        """Items of this shard that search returns."""
        return self.count - self.removed_count

    @property
    def id_end(self) -> int:
        return self.id_start + self.count


@dataclass
class Manifest:
    """Everything needed to search, extend, verify or rebuild an index."""

    model_id: str  # checkpoint id the embeddings came from ('' when unknown)
    dim: int
    metric: str  # ip | l2
    index_type: str  # flat | ivf_flat | ivf_pq
    factory: str  # FAISS index_factory string
    nlist: int
    pq_m: int
    shard_size: int
    train_count: int  # vectors the trained index was trained on
    memory_estimate_bytes: int  # for the expected item count at creation
    trained: FileEntry
    shards: list[ShardEntry] = field(default_factory=list)
    created: str = ""
    updated: str = ""
    versions: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)  # the IndexConfig it was created with
    checkpoint: str = ""  # the checkpoint the embeddings came from (the service loads its query model)
    catalogues: dict = field(default_factory=dict)  # catalogue URI -> {"items", "updated"}
    runs: list = field(default_factory=list)  # the newest RUNS_KEPT run records: added/changed/removed
    next_free_id: int = 0  # ids below this were given out (compaction may have dropped the last shard)
    next_shard: int = 0  # shard names below this were given out: a name is never reused
    format_version: int = FORMAT_VERSION

    @property
    def total(self) -> int:
        """Items search can return: every committed shard's rows less its removed ones."""
        return sum(s.live for s in self.shards)

    @property
    def stored(self) -> int:
        """Rows in all committed shards, removed ones included (what compaction shrinks)."""
        return sum(s.count for s in self.shards)

    @property
    def removed(self) -> int:
        return sum(s.removed_count for s in self.shards)

    @property
    def next_id(self) -> int:
        """The global id the next shard starts at (ids are never reused)."""
        return max(self.next_free_id, self.shards[-1].id_end if self.shards else 0)

    @property
    def next_shard_name(self) -> str:
        """The name the next new shard gets (never one a shard of this index had before)."""
        seqs = [int(s.name.rsplit("-", 1)[-1]) for s in self.shards if s.name.rsplit("-", 1)[-1].isdigit()]
        return shard_name(max([self.next_shard - 1, *seqs], default=-1) + 1)

    def record_run(self, record: dict) -> None:
        """Keep a run's record (what it added, changed, removed), the newest RUNS_KEPT only."""
        self.runs = [*self.runs, record][-RUNS_KEPT:]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self) | {"total": self.total}, indent=2, sort_keys=False)

    @classmethod
    def from_json(cls, text: str, where: str = "") -> Manifest:
        """Parse manifest text; raises IndexIntegrityError naming what is wrong."""
        try:
            data = json.loads(text)
            data.pop("total", None)
            data["trained"] = FileEntry(**data["trained"])
            data["shards"] = [_shard(s) for s in data.get("shards", [])]
            return cls(**data)
        except (KeyError, TypeError, ValueError) as exc:
            raise IndexIntegrityError(f"manifest {where} is not a valid index manifest: {exc}") from exc


def _shard(data: dict) -> ShardEntry:
    removed = data.get("removed")
    return ShardEntry(**(data | {"index": FileEntry(**data["index"]),
                                 "embeddings": FileEntry(**data["embeddings"]),
                                 "removed": FileEntry(**removed) if removed else None}))


def manifest_uri(uri: str) -> str:
    return IndexFolder(uri).manifest


def read_manifest(uri: str) -> Manifest:
    """The manifest of the index at ``uri``; IndexInputError when there is no index there."""
    path = manifest_uri(uri)
    try:
        text = storage.read_text(path)
    except FileNotFoundError as exc:
        raise IndexInputError(f"no index at {uri}: {MANIFEST_FILE} is missing "
                              f"(create one with puma.index.create_index or build_index)") from exc
    return Manifest.from_json(text, path)


def has_manifest(uri: str) -> bool:
    return storage.exists(manifest_uri(uri))


def write_manifest(uri: str, manifest: Manifest) -> None:
    """Write the manifest (atomic rename locally, one PUT on S3): the commit point of every change."""
    manifest.updated = now()
    storage.write_text(manifest_uri(uri), manifest.to_json())


def write_file(uri: str, relpath: str, data: bytes) -> FileEntry:
    """Write ``data`` under the index folder and return its FileEntry (checksum of what was written)."""
    storage.write_bytes(IndexFolder(uri).file(relpath), data)
    return FileEntry(path=relpath, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))


def read_checked(uri: str, entry: FileEntry) -> bytes:
    """A file of the index, refused when its bytes do not match the manifest's sha256."""
    path = IndexFolder(uri).file(entry.path)
    data = storage.read_bytes(path)
    if storage.sha256(data) != entry.sha256:
        raise IndexIntegrityError(f"{path} does not match its manifest checksum; run "
                                  f"puma.index.verify({uri!r}) and rebuild the damaged shard")
    return data


def removed_ids(uri: str, entry: ShardEntry) -> np.ndarray:
    """The shard's removed global ids (sorted int64), checksum checked; empty when it has none."""
    if entry.removed is None:
        return np.zeros(0, dtype=np.int64)
    ids = np.load(io.BytesIO(read_checked(uri, entry.removed)), allow_pickle=False).astype(np.int64)
    if len(ids) != entry.removed_count or (len(ids) and (ids[0] < entry.id_start or ids[-1] >= entry.id_end)):
        raise IndexIntegrityError(f"{entry.name}: its removed-ids file disagrees with the manifest "
                                  f"({len(ids)} ids, manifest says {entry.removed_count}); rebuild the index")
    return ids


def live_rows(uri: str, entry: ShardEntry, removed: np.ndarray | None = None) -> np.ndarray:
    """Bool (count,): True for the shard's rows that are not removed (``removed``: its removed ids,
    when the caller has read them already)."""
    keep = np.ones(entry.count, dtype=bool)
    keep[(removed_ids(uri, entry) if removed is None else removed) - entry.id_start] = False
    return keep


def file_sha256(uri: str) -> str:
    """sha256 of a stored file, streamed."""
    digest = hashlib.sha256()
    for block in storage.iter_chunks(uri):
        digest.update(block)
    return digest.hexdigest()


def orphan_files(uri: str, manifest: Manifest) -> list[str]:
    """Files inside committed shard folders that the manifest does not name (superseded tombstones)."""
    named = {e.path for s in manifest.shards for e in (s.index, s.embeddings, s.removed) if e is not None}
    orphans = []
    for shard in manifest.shards:
        orphans += [f for f in storage.list_files(IndexFolder(uri).shard(shard.name))
                    if shard_file(shard.name, folder_name(f)) not in named]
    return orphans


def orphan_shards(uri: str, manifest: Manifest) -> list[str]:
    """Shard folders under the index that the manifest does not list (unfinished writes)."""
    committed = {s.name for s in manifest.shards}
    return [d for d in IndexFolder(uri).shard_folders() if folder_name(d) not in committed]


def shard_name(seq: int) -> str:
    return f"shard-{seq:05d}"


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
