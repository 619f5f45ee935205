"""Checkpoints: a directory (local or s3://) that describes itself and never needs unpickling.

    puma.checkpoint.files   the files (safetensors weights, config.yaml, meta.json with every file's
                            sha256, written last), written and read back checked; a best/ pointer followed
    puma.checkpoint.model   the model a checkpoint rebuilds, its probe embeddings, its model id
    puma.checkpoint.runs    a run's checkpoints: the one a job uses (configured_checkpoint), its best
                            (published atomically behind best/current.json), its checkpoint folders

Every name is importable from ``puma.checkpoint``.
"""

from __future__ import annotations

from puma.checkpoint.files import (
    CONFIG_FILE,
    LIBRARIES,
    LOSS_FILE,
    META_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    CheckpointError,
    CheckpointState,
    IncompleteCheckpointError,
    flatten_optimizer_state,
    has_checkpoint,
    read_checkpoint,
    read_meta,
    read_weights,
    resolve_checkpoint,
    save_checkpoint,
    unflatten_optimizer_state,
)
from puma.checkpoint.model import (
    PROBE_BATCH,
    PROBE_SEED,
    checkpoint_id,
    load_model,
    load_trainable,
    probe_embeddings,
    probe_images,
    verify_probe,
)
from puma.checkpoint.runs import (
    Found,
    best_checkpoint_uri,
    best_record,
    complete_folders,
    configured_checkpoint,
    newest_complete,
    publish_best,
    scan_run,
)

__all__ = [
    "CONFIG_FILE", "LIBRARIES", "LOSS_FILE", "META_FILE", "MODEL_FILE", "OPTIM_FILE", "PROBE_BATCH",
    "PROBE_SEED", "CheckpointError", "CheckpointState", "Found", "IncompleteCheckpointError",
    "best_checkpoint_uri", "best_record", "checkpoint_id", "complete_folders", "configured_checkpoint",
    "flatten_optimizer_state", "has_checkpoint", "load_model", "load_trainable", "newest_complete",
    "probe_embeddings", "probe_images", "publish_best", "read_checkpoint", "read_meta", "read_weights",
    "resolve_checkpoint", "save_checkpoint", "scan_run", "unflatten_optimizer_state", "verify_probe",
]
