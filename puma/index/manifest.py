"""The index manifest: what an index folder holds, written last so that it is the commit point.

Layout of an index folder (local path or s3://)::

    manifest.json                   this file: model id, dim, metric, type, factory, shards,
                                    checksums of every other file, created/updated, versions
    trained.faiss                   the trained, empty index shared by every shard
    shards/shard-00000/index.faiss  trained.faiss + this shard's vectors (ids = global int64 ids)
    shards/shard-00000/embeddings.parquet
                                    index_id, item_id, embedding float32[E], dataset, label, ...

Global ids are contiguous: shard i holds ids [id_start, id_start + count) in Parquet row order,
so id -> item_id is a row lookup. A shard folder absent from the manifest is an unfinished write:
search ignores it and the next write deletes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field

from puma import storage
from puma.errors import UserError
from puma.index.plan import IndexInputError

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
TRAINED_FILE = "trained.faiss"
SHARDS_DIR = "shards"
SHARD_INDEX_FILE = "index.faiss"
SHARD_EMBEDDINGS_FILE = "embeddings.parquet"
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
    format_version: int = FORMAT_VERSION

    @property
    def total(self) -> int:
        """Items in all committed shards."""
        return sum(s.count for s in self.shards)

    @property
    def next_id(self) -> int:
        """The global id the next shard starts at."""
        return self.shards[-1].id_start + self.shards[-1].count if self.shards else 0

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
    return ShardEntry(**(data | {"index": FileEntry(**data["index"]),
                                 "embeddings": FileEntry(**data["embeddings"])}))


def manifest_uri(uri: str) -> str:
    return storage.join(uri, MANIFEST_FILE)


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
    storage.write_bytes(storage.join(uri, *relpath.split("/")), data)
    return FileEntry(path=relpath, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))


def file_sha256(uri: str) -> str:
    """sha256 of a stored file, streamed."""
    digest = hashlib.sha256()
    for block in storage.iter_chunks(uri):
        digest.update(block)
    return digest.hexdigest()


def orphan_shards(uri: str, manifest: Manifest) -> list[str]:
    """Shard folders under the index that the manifest does not list (unfinished writes)."""
    committed = {s.name for s in manifest.shards}
    return [d for d in storage.list_dirs(storage.join(uri, SHARDS_DIR))
            if d.rstrip("/").rsplit("/", 1)[-1] not in committed]


def shard_name(seq: int) -> str:
    return f"shard-{seq:05d}"


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
