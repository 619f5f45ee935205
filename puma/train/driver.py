"""The training driver: datasets, TorchTrainer, run/failure/checkpoint configs, and the result."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray.data
import ray.train
from ray.train.torch import TorchTrainer

from puma import storage
from puma.config import Config, absolute_paths, to_dict
from puma.train.loop import BEST_DIR, train_loop_per_worker


@dataclass
class TrainOutcome:
    """What a finished run left behind."""

    run_uri: str
    best_checkpoint: str
    last_checkpoint: str | None
    metrics: dict[str, Any]


def run_uri(cfg: Config) -> str:
    """Where this run's checkpoints and logs live: <train.storage_path>/<train.run_name>."""
    return storage.join(cfg.train.storage_path, cfg.train.run_name)


def scaling_config(cfg: Config) -> ray.train.ScalingConfig:
    """Workers, GPUs and CPU fractions from config (fractional CPUs leave room for Ray Data)."""
    resources = {"CPU": cfg.train.cpus_per_worker}
    if cfg.train.use_gpu:
        resources["GPU"] = cfg.train.gpus_per_worker
    return ray.train.ScalingConfig(num_workers=cfg.train.num_workers, use_gpu=cfg.train.use_gpu,
                                   resources_per_worker=resources)


def run_config(cfg: Config, callbacks: list | None = None) -> ray.train.RunConfig:
    """Storage (local or S3 through the one storage layer), failure handling, retention."""
    path = cfg.train.storage_path
    filesystem = None
    if storage.is_s3(path):
        filesystem, path = storage.resolve(path)
    else:
        _, path = storage.resolve(path)
    return ray.train.RunConfig(
        name=cfg.train.run_name, storage_path=path, storage_filesystem=filesystem,
        failure_config=ray.train.FailureConfig(max_failures=cfg.train.max_failures),
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.train.checkpoints_to_keep),
        callbacks=callbacks)


def build_datasets(cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    """The train and evaluation Ray Datasets, and what the workers need to know about labels."""
    from puma.data import pipeline
    from puma.data.prepare import ensure_prepared
    from puma.data.splits import global_label_map

    manifest = ensure_prepared(cfg)
    label_map = global_label_map(manifest, cfg.data.val_fraction, cfg.data.datasets)
    mean, std = backbone_normalisation(cfg)
    train = pipeline.train_dataset(cfg, manifest, label_map, mean, std)
    evaluation = pipeline.eval_dataset(cfg, manifest, cfg.train.eval_split, mean, std)
    info = {"num_classes": len(label_map), "label_map": {f"{d}/{c}": i for (d, c), i in label_map.items()}}
    return {"train": train, "eval": evaluation}, info


def backbone_normalisation(cfg: Config) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Mean and std from the backbone's timm pretrained config (no weights are loaded)."""
    import timm

    pretrained = timm.models.get_pretrained_cfg(cfg.model.backbone.name)
    if pretrained is None:
        return (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    return tuple(pretrained.mean), tuple(pretrained.std)


def run_training(cfg: Config, callbacks: list | None = None) -> TrainOutcome:
    """Fit PUMA with Ray Train; re-running the same run name resumes from its last checkpoint.

    ``callbacks`` are Ray Train callbacks, e.g. Tune's TuneReportCallback inside a sweep trial.
    """
    cfg = absolute_paths(cfg)
    storage.configure(cfg.storage)
    ray.data.DataContext.get_current().enable_progress_bars = False  # per-epoch lines come from the loop
    datasets, info = build_datasets(cfg)
    uri = run_uri(cfg)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": to_dict(cfg), "run_uri": uri, **info},
        scaling_config=scaling_config(cfg), run_config=run_config(cfg, callbacks), datasets=datasets,
        dataset_config=ray.train.DataConfig(datasets_to_split=["train"]))
    result = trainer.fit()
    last = result.checkpoint.path if result.checkpoint is not None else None
    return TrainOutcome(run_uri=uri, best_checkpoint=storage.join(uri, BEST_DIR),
                        last_checkpoint=last, metrics=dict(result.metrics or {}))
