"""A training run's folder, ``<train.storage_path>/<train.run_name>``: the one place its layout is named.

    <run>/checkpoint_epoch0003_attempt001/  a checkpoint (Ray Train uploads it; puma.checkpoint's files)
    <run>/checkpoint_manager_snapshot.json  Ray Train's record of the checkpoints it registered
    <run>/best/current.json                 which version folder best/ stands for (puma.checkpoint)
    <run>/best/epoch0003_attempt001/        a version of the best checkpoint
    <run>/attempts/attempt_0001.json        what each attempt continued from (puma.train.recovery)
    <run>/tensorboard/                      TensorBoard event files (staged locally for s3:// runs)
    <run>/data_rejects.jsonl                images the training pipeline could not use (default)
    <run>/report/                           jobs/report.py's page and record (default)

Local paths and s3:// alike; every name goes through puma.storage. Ray Train is handed the run as
``storage_path`` + ``name`` (:meth:`RunFolder.ray_storage`) and builds this same folder itself; the
paths it hands back (scheme-less on S3) are mapped into the run's own URI by :meth:`RunFolder.child`.
What is *in* a checkpoint and which checkpoint is complete is puma.checkpoint's business.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass

from puma import storage

CHECKPOINT_PREFIX = "checkpoint_"
BEST = "best"
BEST_POINTER = "current.json"
ATTEMPTS = "attempts"
TENSORBOARD = "tensorboard"
DATA_REJECTS = "data_rejects.jsonl"
REPORT = "report"


def folder_name(uri: str) -> str:
    """The last path component of a folder URI (or of a path Ray hands back)."""
    return str(uri).rstrip("/").rsplit("/", 1)[-1]


def checkpoint_name(epoch: int, attempt: int) -> str:
    """The folder name of the checkpoint written after ``epoch`` by ``attempt`` (unique per run)."""
    return f"{CHECKPOINT_PREFIX}{version_label(epoch, attempt)}"


def version_label(epoch: int, attempt: int) -> str:
    """The epoch and attempt as a name stem: a checkpoint's (after its prefix) and a best/ version's."""
    return f"epoch{epoch:04d}_attempt{attempt:03d}"


def is_checkpoint_name(name: str) -> bool:
    return name.startswith(CHECKPOINT_PREFIX)


@dataclass(frozen=True)
class RunFolder:
    """The folder of one run (a local path or s3:// URI) and the names of its parts."""

    uri: str

    @classmethod
    def of(cls, cfg) -> RunFolder:
        """The run folder a config names: <train.storage_path>/<train.run_name>."""
        return cls(storage.join(cfg.train.storage_path, cfg.train.run_name))

    @property
    def name(self) -> str:
        return folder_name(self.uri)

    @property
    def parent(self) -> str:
        return str(self.uri).rstrip("/")[: -len(self.name)].rstrip("/") or "."

    def ray_storage(self):
        """(storage_path, name, filesystem) for Ray Train's RunConfig: Ray builds <path>/<name>, this run."""
        path, filesystem = storage.ray_storage(self.parent)
        return path, self.name, filesystem

    def child(self, path: str) -> str:
        """A folder of this run given any path ending in its name (Ray's paths have no scheme on S3)."""
        return storage.join(self.uri, folder_name(path))

    def checkpoint(self, epoch: int, attempt: int) -> str:
        return storage.join(self.uri, checkpoint_name(epoch, attempt))

    def checkpoint_folders(self) -> list[str]:
        """Every checkpoint folder of the run, in listing order (complete or not)."""
        return [uri for uri in storage.list_dirs(self.uri) if is_checkpoint_name(folder_name(uri))]

    @property
    def best(self) -> str:
        """The best checkpoint (puma.checkpoint.publish_best writes it, resolve_checkpoint reads it)."""
        return storage.join(self.uri, BEST)

    @property
    def attempts(self) -> str:
        return storage.join(self.uri, ATTEMPTS)

    def attempt_record(self, attempt: int) -> str:
        return storage.join(self.attempts, f"attempt_{attempt:04d}.json")

    def recorded_attempts(self) -> list[int]:
        """The numbers of the attempts recorded in attempts/."""
        names = [folder_name(u) for u in storage.list_files(self.attempts, suffix=".json", recursive=False)]
        return [int(n[len("attempt_"):-len(".json")]) for n in names if n.startswith("attempt_")]

    @property
    def tensorboard(self) -> str:
        return storage.join(self.uri, TENSORBOARD)

    def tensorboard_staging(self) -> str:
        """The local folder an s3:// run's event files are written to before each upload: one per run
        (named by a hash of its URI), so runs on one node (sweep trials) never upload each other's."""
        digest = hashlib.sha256(str(self.uri).encode()).hexdigest()[:16]
        return os.path.join(tempfile.gettempdir(), "puma-tb", digest)

    @property
    def data_rejects(self) -> str:
        """Where the training pipeline records rejected images unless data.rejects_uri says otherwise."""
        return storage.join(self.uri, DATA_REJECTS)

    @property
    def report(self) -> str:
        """Where jobs/report.py writes the run's report unless --out says otherwise."""
        return storage.join(self.uri, REPORT)
