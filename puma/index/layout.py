"""An index location, ``index.uri``, and the index folders in it: the one place their layout is named.

    <location>/alias.json                       which version is live, which was before (puma.index.versions)
    <location>/versions/m-<16 hex>/             one index folder per model (below)
    <location>/rejects/<catalogue>.jsonl        items of a catalogue the embedding job could not index

An index folder (a version; or the location itself when it was written before versions, with
``manifest.json`` at its root)::

    <index>/manifest.json                       what the folder holds, written last (puma.index.manifest)
    <index>/trained.faiss                       the trained, empty index shared by every shard
    <index>/shards/shard-00000/index.faiss      trained.faiss + this shard's vectors
    <index>/shards/shard-00000/embeddings.parquet
    <index>/shards/shard-00000/removed-<sha256[:16]>.npy
    <index>/evaluation.json                     jobs/evaluate.py's metrics (default; puma.eval.index_eval)

Local paths and s3:// alike; every name goes through puma.storage. The manifest names each file of
the folder by its path relative to the folder (``FileEntry.path``, always ``/``-separated:
:func:`shard_file`); :meth:`IndexFolder.file` turns that path into the file's URI. What the files
hold, and which version is live, are puma.index.manifest's and puma.index.versions' business.
"""

from __future__ import annotations

from dataclasses import dataclass

from puma import storage

ALIAS_FILE = "alias.json"
VERSIONS_DIR = "versions"
REJECTS_DIR = "rejects"
MANIFEST_FILE = "manifest.json"
TRAINED_FILE = "trained.faiss"
SHARDS_DIR = "shards"
SHARD_INDEX_FILE = "index.faiss"
SHARD_EMBEDDINGS_FILE = "embeddings.parquet"
REMOVED_PREFIX = "removed-"
EVALUATION_FILE = "evaluation.json"


def folder_name(uri: str) -> str:
    """The last path component of a folder URI."""
    return str(uri).rstrip("/").rsplit("/", 1)[-1]


def shard_file(shard: str, name: str) -> str:
    """A file of shard ``shard`` as the manifest names it: ``shards/<shard>/<name>``."""
    return f"{SHARDS_DIR}/{shard}/{name}"


def removed_file(sha256: str) -> str:
    """The name of a shard's removed-ids file whose bytes have this sha256."""
    return f"{REMOVED_PREFIX}{sha256[:16]}.npy"


@dataclass(frozen=True)
class IndexLocation:
    """An index location (``index.uri``, a local path or s3:// URI) and the names of its parts."""

    uri: str

    @property
    def alias(self) -> str:
        return storage.join(self.uri, ALIAS_FILE)

    @property
    def versions(self) -> str:
        return storage.join(self.uri, VERSIONS_DIR)

    def version(self, version: str) -> str:
        """The index folder of a version."""
        return storage.join(self.uri, VERSIONS_DIR, version)

    def index(self, version: str) -> str:
        """The index folder a writer of ``version`` writes: the version's, or the location itself for ''
        (a location written before versions)."""
        return self.version(version) if version else self.uri

    def version_folders(self) -> list[str]:
        """Every folder under versions/, in listing order (with a manifest or not)."""
        return storage.list_dirs(self.versions)

    def rejects(self, catalogue: str) -> str:
        """Where the embedding job lists the rejects of the catalogue named ``catalogue``."""
        return storage.join(self.uri, REJECTS_DIR, f"{catalogue}.jsonl")


@dataclass(frozen=True)
class IndexFolder:
    """One index folder (a version, or a location without versions) and the names of its parts."""

    uri: str

    @property
    def manifest(self) -> str:
        return storage.join(self.uri, MANIFEST_FILE)

    @property
    def trained(self) -> str:
        return storage.join(self.uri, TRAINED_FILE)

    @property
    def shards(self) -> str:
        return storage.join(self.uri, SHARDS_DIR)

    def shard(self, name: str) -> str:
        """A shard's folder."""
        return storage.join(self.uri, SHARDS_DIR, name)

    def shard_folders(self) -> list[str]:
        """Every folder under shards/, committed or not, in listing order."""
        return storage.list_dirs(self.shards)

    def file(self, path: str) -> str:
        """The URI of a file the manifest names by its path in the folder (``FileEntry.path``)."""
        return storage.join(self.uri, *path.split("/"))

    @property
    def evaluation(self) -> str:
        """Where jobs/evaluate.py writes its metrics unless --out says otherwise."""
        return storage.join(self.uri, EVALUATION_FILE)
