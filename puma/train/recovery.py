"""Where a run continues from: the newest complete checkpoint in its folder, never an older one.

No Ray here (the worker loop hands in what Ray knows); every path goes through ``puma.storage``, so
the same rules hold for a local run folder and an s3:// one.

Why Ray's own checkpoint is not enough (read in Ray 2.60's Train V2 source, ray/train/v2/_internal/
execution/; measured on a `ray start --head` cluster and with a job-owned local Ray):

- A worker's ``ray.train.report(checkpoint=...)`` first uploads the folder into the run folder, then
  puts the report on a one-slot queue (``context.py`` ``_wait_then_report``; ``worker.py``
  ``queue.Queue(maxsize=1)``) and blocks while that slot is full.
- The controller takes one report per worker per poll, every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``
  (2 s), and only then registers the checkpoint and rewrites ``checkpoint_manager_snapshot.json``
  (``checkpoint_manager.py`` ``register_checkpoint``). Storage therefore runs up to two complete
  checkpoints ahead of the snapshot: one waiting in the slot, one uploaded behind it.
- Driver dies on a cluster that outlives it (``ray job submit``): the GCS kills the driver-owned
  controller and its workers within a fraction of a second, so nothing more is registered. A re-run
  loads the stale snapshot and ``ray.train.get_checkpoint()`` returns the last *registered*
  checkpoint: None right after the first checkpoint (the run started over), one or two epochs
  behind later.
- A worker dies: the controller drops the group's pending reports
  (``report_handler.py`` ``before_worker_group_shutdown``) and hands the new group its latest
  registered checkpoint (``checkpoint_manager.py`` ``before_init_train_context``): the same lag.
- Job-owned local Ray, whole process group killed: the driver, GCS and raylet die at once, but Ray's
  worker processes (the controller is one) run in process groups of their own and live about 3 s
  longer, long enough for one more poll to register the pending checkpoint and write the snapshot.
  That is why the local re-run happened to resume from the right place.

So every attempt (rank 0) lists the run folder, orders the checkpoint folders by the epoch in their
meta.json, and continues from the newest that is complete (every file matches the sha256 in
meta.json) and reproduces its probe embeddings, or from Ray's if that is newer. Incomplete folders
are reported and removed; folders Ray never registered fall under ``train.checkpoints_to_keep``
here, because Ray's retention only knows the ones it registered (and a folder its snapshot still
names must never be removed: Ray refuses to start on a run folder whose snapshot names a missing
checkpoint). Each attempt leaves a record in ``<run>/attempts/``.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from puma import storage
from puma.checkpoint import (
    CheckpointError,
    CheckpointState,
    Found,
    IncompleteCheckpointError,
    best_record,
    newest_complete,
    publish_best,
    scan_run,
)
from puma.run_folder import RunFolder, folder_name

T = TypeVar("T")


@dataclass
class ResumePlan:
    """What an attempt continues from, and what it found on the way."""

    run_uri: str
    attempt: int
    source: Found | None = None  # the checkpoint to continue from (None: start at epoch 1)
    ray_checkpoint: str | None = None  # the folder Ray Train handed over (its latest registered one)
    ray_epoch: int | None = None
    incomplete: list[str] = field(default_factory=list)  # folders without a complete set of files
    skipped: list[tuple[str, str]] = field(default_factory=list)  # newer complete folders not usable: why
    behind: list[Found] = field(default_factory=list)  # the source, then older complete folders, newest first
    highest_epoch: int = 0  # the newest epoch any folder claims
    workers: list[dict] = field(default_factory=list)  # where each rank of the attempt runs (node, host, pid)

    @property
    def epoch(self) -> int:
        """Epochs already done (the source's epoch)."""
        return self.source.epoch if self.source is not None else 0

    @property
    def orphans(self) -> list[str]:
        """Complete folders older than the source that Ray never registered."""
        return [f.uri for f in self.behind[1:] if not f.registered]

    @property
    def recomputed(self) -> int:
        """Epochs that had been written to storage and will be trained again (0 is the goal)."""
        return max(0, self.highest_epoch - self.epoch)

    def record(self) -> dict[str, Any]:
        """The attempt record written to <run>/attempts/."""
        return {"attempt": self.attempt, "resumed_from": self.source.name if self.source else None,
                "after_epoch": self.epoch, "ray_checkpoint": self.ray_checkpoint, "ray_epoch": self.ray_epoch,
                "incomplete": self.incomplete, "skipped": [list(s) for s in self.skipped],
                "orphans": [folder_name(u) for u in self.orphans], "recomputed_epochs": self.recomputed,
                "host": socket.gethostname(), "workers": self.workers,
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def plan_resume(run_uri: str, ray_checkpoint: str | None, registered: set[str],
                load: Callable[[str], T]) -> tuple[ResumePlan, T | None]:
    """Choose the newest complete checkpoint of the run and load it with ``load`` (uri -> state).

    ``ray_checkpoint`` is the folder name of Ray's checkpoint (``ray.train.get_checkpoint()``),
    ``registered`` the names Ray's snapshot holds. ``load`` raises IncompleteCheckpointError for a
    folder with missing or damaged files (reported, then removed by :func:`remove_incomplete`) and
    CheckpointError for one that does not reproduce its probe embeddings with this model (reported,
    kept). When complete checkpoints exist and none can be used, this raises instead of starting over.
    """
    found = scan_run(run_uri, registered | ({ray_checkpoint} if ray_checkpoint else set()))
    plan = ResumePlan(run_uri, next_attempt(run_uri, found), ray_checkpoint=ray_checkpoint)
    plan.ray_epoch = next((f.epoch for f in found if f.name == ray_checkpoint), None)
    plan.highest_epoch = max([f.epoch for f in found if f.epoch is not None], default=0)
    loaded: T | None = None
    for folder in found:
        if folder.epoch is None:
            plan.incomplete.append(folder.name)
        elif plan.source is not None:
            plan.behind.append(folder)
        else:
            try:
                loaded, plan.source = load(folder.uri), folder
                plan.behind.append(folder)
            except IncompleteCheckpointError:
                plan.incomplete.append(folder.name)
            except CheckpointError as exc:
                plan.skipped.append((folder.name, " ".join(str(exc).split())))
    if plan.source is None and plan.skipped:
        raise CheckpointError(f"{run_uri} holds {len(plan.skipped)} complete checkpoint(s) but none fits "
                              f"this model, so the run cannot continue and will not start over; newest: "
                              f"{plan.skipped[0][1]}. Restore the model config and backbone weights it was "
                              f"trained with, or start a new run with another train.run_name")
    return plan, loaded


def next_attempt(run_uri: str, found: list[Found]) -> int:
    """One more than any attempt recorded in the run's attempts/ or in a checkpoint's run state."""
    return max(RunFolder(run_uri).recorded_attempts() + [f.attempt for f in found], default=0) + 1


def record_attempt(plan: ResumePlan) -> str:
    """Write the run's attempt record: what this attempt continues from, and what it found."""
    uri = RunFolder(plan.run_uri).attempt_record(plan.attempt)
    storage.write_text(uri, json.dumps(plan.record(), indent=2, sort_keys=True))
    return uri


def remove_incomplete(plan: ResumePlan, registered: set[str]) -> list[str]:
    """Remove the incomplete folders Ray never registered (debris of a kill during a write)."""
    removed = [name for name in plan.incomplete if name not in registered]
    for name in removed:
        storage.delete(RunFolder(plan.run_uri).child(name))
    return removed


@dataclass
class Retention:
    """``train.checkpoints_to_keep`` for the folders Ray does not manage.

    Ray keeps the newest ``keep`` of the checkpoints it registered, and knows no others. A folder
    written but never registered (the lag after a kill: often the very checkpoint an attempt resumes
    from) is ours to remove: as soon as it is no longer among the newest ``keep`` complete
    checkpoints of the run, counting the ones this attempt has written (each is complete on storage
    when counted). A registered folder is never removed here: Ray's snapshot names it, and Ray
    refuses to start on a run folder whose snapshot names a missing checkpoint; Ray's retention
    removes it once it has registered ``keep`` newer ones.
    """

    keep: int
    behind: list[Found] = field(default_factory=list)  # the attempt's source, then older complete folders
    written: int = 0

    def after_checkpoint(self) -> list[str]:
        """Count one checkpoint written by this attempt; remove the unregistered folders it has outranked."""
        self.written += 1
        still_newest = max(0, max(1, self.keep) - self.written)  # of `behind`, still in the newest keep
        removed = [f.uri for f in self.behind[still_newest:] if not f.registered]
        self.behind = [f for i, f in enumerate(self.behind) if i < still_newest or f.registered]
        for uri in removed:
            storage.delete(uri)
        return removed


def plan_summary(plan: ResumePlan) -> list[str]:
    """The lines an attempt logs: one 'resumed from' line (or where it starts), then what it found."""
    lines = []
    if plan.source is not None:
        lines.append(f"resumed from {plan.source.uri} after epoch {plan.epoch} (attempt {plan.attempt})")
        if plan.ray_checkpoint != plan.source.name:
            ray = f"after epoch {plan.ray_epoch} ({plan.ray_checkpoint})" if plan.ray_checkpoint else "none"
            lines.append(f"Ray Train's registered checkpoint: {ray}; the run folder holds a newer one")
    elif plan.attempt > 1:
        lines.append(f"starting at epoch 1 (attempt {plan.attempt}): no complete checkpoint in "
                     f"{plan.run_uri}")
    lines += [f"ignored incomplete checkpoint folder {name}" for name in plan.incomplete]
    lines += [f"ignored checkpoint {name}: {why}" for name, why in plan.skipped]
    if plan.recomputed:
        lines.append(f"{plan.recomputed} epoch(s) written before will be trained again")
    return lines


@dataclass
class Best:
    """The best model so far: its metric value and epoch, and whether a cut-off best/ write was finished."""

    value: float
    epoch: int
    published: bool = False
    unreadable: str = ""  # why best/ could not be read (then the next evaluated epoch replaces it)


def reconcile_best(best_uri: str, metric: str, best_value: float, best_epoch: int,
                   ckpt: CheckpointState | None, label: str) -> Best:
    """The best value and epoch a resumed run carries on with: those of the model in best/.

    The checkpoint of an improving epoch is complete before best/ is switched to it, so a resumed
    checkpoint that names itself the best (``best_epoch`` is its epoch) while best/ holds something
    worse (or nothing) lost a crash between the two writes: it is published now, as ``label``.
    """
    try:
        held = best_record(best_uri, metric)
    except CheckpointError as exc:  # e.g. its version folder was removed by hand: nothing to keep
        held, unreadable = None, " ".join(str(exc).split())
    else:
        unreadable = ""
    held_value = held["value"] if held is not None and held["value"] is not None else float("-inf")
    epoch = int(ckpt.meta["epoch"]) if ckpt is not None else 0
    if ckpt is not None and best_epoch == epoch > 0 and best_value > held_value:
        publish_best(best_uri, ckpt, label)
        return Best(best_value, best_epoch, published=True)
    if held is None:
        return Best(float("-inf"), 0, unreadable=unreadable)
    return Best(held_value, int(held["epoch"] or 0))


@dataclass
class ResumedStream:
    """The training stream as Ray Train's controller fetches it for every worker group it starts (the
    first, and each one after a lost worker): starting at the epoch the group will resume from, the
    run's newest complete checkpoint, so an epoch's shuffle and crops are the same with or without a
    resume (``pipeline.start_at_epoch``). It lives here, not in the driver's module: the controller
    unpickles it, and importing the driver's module there would import the model, the losses and
    their libraries (about 5 CPU seconds a run) in a process that never trains."""

    dataset: Any  # ray.data.Dataset
    run_uri: str
    storage_settings: Any  # storage.current_config() of the driver: the controller is another process

    def __call__(self):
        from puma.data.pipeline import start_at_epoch

        storage.configure(self.storage_settings)
        found = newest_complete(self.run_uri)
        return start_at_epoch(self.dataset, found.epoch if found is not None else 0)
