"""A run's checkpoints: the one the jobs use, its best (published atomically), and its checkpoint folders.

A run's best checkpoint (``<run>/best``) is replaced atomically on local paths and S3 alike: each
new best is written to a version folder ``best/<version>/`` and then ``best/current.json`` (one
object, written in one put or rename) is switched to name it; readers resolve the pointer
(:func:`puma.checkpoint.resolve_checkpoint`), so ``<run>/best`` always reads as one complete checkpoint,
the old or the new. A ``best/`` without a pointer (written before versions existed) is read as before.

The checkpoint a job embeds, serves or reports on (:func:`configured_checkpoint`): the one it is
given, else embed.checkpoint, else the run's best, <train.storage_path>/<train.run_name>/best.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from puma import storage
from puma.checkpoint.files import (
    CheckpointError,
    CheckpointState,
    has_checkpoint,
    read_checkpoint,
    read_meta,
    resolve_checkpoint,
    save_checkpoint,
)
from puma.config import Config
from puma.run_folder import BEST_POINTER, RunFolder, folder_name


def best_record(best_uri: str, metric: str) -> dict[str, Any] | None:
    """What best/ holds, as ``{"checkpoint", "epoch", "value"}`` (``value``: its ``metric``, None when it
    has none); None when there is no best checkpoint yet."""
    if not has_checkpoint(best_uri):
        return None
    meta = read_meta(best_uri)
    value = meta.get("metrics", {}).get(metric)
    return {"checkpoint": resolve_checkpoint(best_uri), "epoch": meta.get("epoch"),
            "value": None if value is None else float(value)}


def publish_best(best_uri: str, state: CheckpointState, label: str) -> str:
    """Make ``state`` (less its optimiser state) the best checkpoint atomically: write the version folder
    ``<label>_<random>``,
    switch best/current.json to it (one put or rename), then remove all but it and the previous one.

    A crash at any moment leaves best/ reading as the old or the new checkpoint, each complete.
    """
    previous = _pointer_target(best_uri)
    version = f"{label}_{secrets.token_hex(4)}"
    state = CheckpointState(config=state.config, model=state.model, loss=state.loss, meta=state.meta)
    save_checkpoint(storage.join(best_uri, version), state)
    record = {"checkpoint": version, "epoch": state.meta.get("epoch"), "previous": previous}
    storage.write_text(storage.join(best_uri, BEST_POINTER), json.dumps(record, indent=2, sort_keys=True))
    _remove_stale_versions(best_uri, keep={version, previous})
    return storage.join(best_uri, version)


def _pointer_target(best_uri: str) -> str | None:
    pointer = storage.join(best_uri, BEST_POINTER)
    return json.loads(storage.read_text(pointer))["checkpoint"] if storage.exists(pointer) else None


def _remove_stale_versions(best_uri: str, keep: set[str | None]) -> None:
    """Versions other than ``keep``, and files of the pre-pointer layout, once the pointer has moved on.

    The previous version stays, so a reader that resolved the pointer just before the switch can
    still read it.
    """
    for uri in storage.list_dirs(best_uri):
        if folder_name(uri) not in keep:
            storage.delete(uri)
    for uri in storage.list_files(best_uri, recursive=False):
        if folder_name(uri) != BEST_POINTER:
            storage.delete(uri)


def best_checkpoint_uri(cfg: Config) -> str:
    """Where training keeps its best checkpoint: <train.storage_path>/<train.run_name>/best."""
    return RunFolder.of(cfg).best


def configured_checkpoint(cfg: Config, checkpoint: str | None = None) -> str:
    """The checkpoint a job uses, as an absolute URI: ``checkpoint``, else embed.checkpoint, else
    <train.storage_path>/<train.run_name>/best (a best/ pointer is left to :func:`resolve_checkpoint`)."""
    return storage.absolute(checkpoint or cfg.embed.checkpoint or best_checkpoint_uri(cfg))


# ----------------------------------------------------------------------------- a run's checkpoints


@dataclass
class Found:
    """A checkpoint folder in a run folder."""

    name: str
    uri: str
    epoch: int | None  # from its meta.json; None when meta.json is missing or unreadable
    attempt: int  # the attempt that wrote it (0: unknown, written before attempts were counted)
    registered: bool  # Ray Train's snapshot names it: only Ray may remove it


def scan_run(run_uri: str, registered: set[str] = frozenset()) -> list[Found]:
    """Every checkpoint folder of the run, newest first (by epoch, then attempt, then name)."""
    found = []
    for uri in RunFolder(run_uri).checkpoint_folders():
        name = folder_name(uri)
        try:
            meta = read_meta(uri)
            epoch, attempt = int(meta["epoch"]), int(meta.get("run_state", {}).get("attempt", 0))
        except (CheckpointError, KeyError, TypeError, ValueError):
            epoch, attempt = None, 0
        found.append(Found(name, uri, epoch, attempt, name in registered))
    return sorted(found, key=lambda f: (-1 if f.epoch is None else f.epoch, f.attempt, f.name), reverse=True)


def complete_folders(run_uri: str):
    """The run's checkpoint folders whose files all match their checksums, newest first (no probe check)."""
    for folder in scan_run(run_uri):
        if folder.epoch is None:
            continue
        try:
            read_checkpoint(folder.uri, with_optimizer=True)
        except CheckpointError:
            continue
        yield folder


def newest_complete(run_uri: str) -> Found | None:
    """The newest checkpoint folder of the run whose files all match their checksums (no probe check)."""
    return next(complete_folders(run_uri), None)
