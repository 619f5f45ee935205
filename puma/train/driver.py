"""The training driver: datasets, TorchTrainer, run/failure/checkpoint configs, and the result."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import ray.data
import ray.train
from ray.train.torch import TorchTrainer

from puma import console, storage
from puma.checkpoint import has_checkpoint, newest_complete, read_meta
from puma.config import Config, ConfigError, for_this_process, to_dict
from puma.errors import UserError
from puma.methods import METHODS, check_config, get_method
from puma.run_folder import RunFolder
from puma.train.data_init import check_data_init, needs_data_init
from puma.train.loop import TRAIN_EVAL, train_loop_per_worker
from puma.train.recovery import ResumedStream


@dataclass
class TrainOutcome:
    """What a finished run left behind."""

    run_uri: str
    best_checkpoint: str
    last_checkpoint: str | None
    metrics: dict[str, Any]


def worker_resources(cfg: Config) -> dict[str, float]:
    """What each training worker reserves: its CPU fraction, GPUs (train.use_gpu) and custom resources."""
    resources = {"CPU": cfg.train.cpus_per_worker, **cfg.train.worker_resources}
    if cfg.train.use_gpu:
        resources["GPU"] = cfg.train.gpus_per_worker
    return resources


def scaling_config(cfg: Config) -> ray.train.ScalingConfig:
    """Workers, GPUs and CPU fractions from config (fractional CPUs leave room for Ray Data)."""
    return ray.train.ScalingConfig(num_workers=cfg.train.num_workers, use_gpu=cfg.train.use_gpu,
                                   resources_per_worker=worker_resources(cfg),
                                   placement_strategy=cfg.train.placement_strategy)


def placement_shortfall(cfg: Config, nodes: list[dict[str, float]]) -> str | None:
    """Why ``nodes`` (each alive node's total resources) can never hold the run's worker group at
    once, or None if they can: the workers each node holds by itself, combined as
    train.placement_strategy allows (STRICT_SPREAD: one per node, STRICT_PACK: all on one node)."""
    need, wanted, strategy = worker_resources(cfg), cfg.train.num_workers, cfg.train.placement_strategy
    limits = {k: v for k, v in need.items() if v > 0}  # a zero amount (gpus_per_worker=0) never limits
    holds = [min(math.floor(node.get(k, 0.0) / v + 1e-9) for k, v in limits.items()) for node in nodes]
    room = {"STRICT_SPREAD": sum(h >= 1 for h in holds), "STRICT_PACK": max(holds, default=0)}.get(
        strategy, sum(holds))
    if room >= wanted:
        return None
    totals = {k: sum(node.get(k, 0.0) for node in nodes) for k in need}
    return (f"train.num_workers={wanted} workers of {_amounts(need)} each ({strategy}) do not fit: the "
            f"{len(nodes)} alive node(s), {_amounts(totals)} in all, hold {room} at once")


def _amounts(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


def check_placement(cfg: Config, local: bool, nodes: list[dict[str, float]] | None = None) -> None:
    """The worker group against the cluster's alive nodes (``nodes``: given instead of asked of Ray),
    before Ray Train waits for it (silently, for ever): on a local Ray, where no node will join, a
    ConfigError saying what to lower; on a joined cluster a notice, as an autoscaler may still add nodes."""
    if nodes is None:
        nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    why = placement_shortfall(cfg, nodes)
    if why is None:
        return
    if local:
        raise ConfigError(f"{why} on this local Ray: lower train.num_workers, train.cpus_per_worker or "
                          "train.worker_resources, or join a larger cluster with RAY_ADDRESS")
    console.say(f"waiting for nodes: {why}; the run starts once nodes that can hold them join (an "
                "autoscaler adds them), Ctrl-C stops it")


def check_placement_before_ray(cfg: Config) -> None:
    """check_placement before Ray starts, when the job will start a local Ray: against the node that Ray
    will be (puma.runtime.local_node_resources), so a worker group it can never hold fails in seconds,
    not after Ray's start. Joining a cluster, nothing here: its nodes are asked once joined."""
    from puma.runtime import joins_cluster, local_node_resources

    if not joins_cluster():
        check_placement(cfg, local=True, nodes=[local_node_resources()])


def data_config(cfg: Config) -> ray.train.DataConfig:
    """The train split across workers; with data.deterministic, in a fixed order (preserve_order: Ray
    Data's output splitter then gives each worker the same rows every run, ignoring locality)."""
    options = None
    if cfg.data.deterministic:
        options = ray.train.DataConfig.default_ingest_options()
        options.preserve_order = True
    return ray.train.DataConfig(datasets_to_split=["train"], execution_options=options)


def run_config(cfg: Config, callbacks: list | None = None) -> ray.train.RunConfig:
    """Storage (local or S3 through the one storage layer), failure handling, retention."""
    path, name, filesystem = RunFolder.of(cfg).ray_storage()
    return ray.train.RunConfig(
        name=name, storage_path=path, storage_filesystem=filesystem,
        failure_config=ray.train.FailureConfig(max_failures=cfg.train.max_failures),
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.train.checkpoints_to_keep),
        callbacks=callbacks)


def build_datasets(cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    """The train and evaluation Ray Datasets, and what the workers need to know about labels.

    A method that makes its own labels (udml_ss) also gets the training images in the eval view
    (``train_eval``) to cluster. Unlabeled datasets train only such methods; with no labeled test
    classes selected, training-time evaluation is skipped (``info["eval_skipped"]`` says why).
    """
    from puma.data import pipeline
    from puma.data.images import backbone_normalisation
    from puma.data.prepare import ensure_prepared
    from puma.data.splits import global_label_map, label_range, labeled_datasets

    manifest = ensure_prepared(cfg)
    check_labels_for_method(cfg, manifest)
    label_map = global_label_map(manifest, cfg.data.val_fraction, cfg.data.datasets)
    mean, std = backbone_normalisation(cfg)
    datasets = {"train": ResumedStream(pipeline.train_dataset(cfg, manifest, label_map, mean, std),
                                       RunFolder.of(cfg).uri, storage.current_config())}
    train_rows = pipeline.count_rows(cfg, manifest, "train")
    info: dict[str, Any] = {"num_classes": len(label_map),
                            "label_map": {f"{d}/{c}": i for (d, c), i in label_map.items()},
                            "steps_per_epoch": steps_per_epoch(cfg, train_rows)}
    if any(len(label_range(manifest, n, cfg.train.eval_split, cfg.data.val_fraction))
           for n in labeled_datasets(manifest, cfg.data.datasets)):
        datasets["eval"] = pipeline.eval_dataset(cfg, manifest, cfg.train.eval_split, mean, std)
        info["eval_rows"] = pipeline.count_rows(cfg, manifest, cfg.train.eval_split)
    else:
        info["eval_skipped"] = (f"no labeled {cfg.train.eval_split} classes in {manifest.uri} (datasets "
                                f"{manifest.select(cfg.data.datasets)}): evaluation needs labels")
    if get_method(cfg.model.method).needs_train_eval or needs_data_init(cfg):
        datasets[TRAIN_EVAL] = pipeline.eval_dataset(cfg, manifest, "train", mean, std)
    return datasets, info


def steps_per_epoch(cfg: Config, rows: int) -> int:
    """Optimiser steps of one epoch: each worker's equal share of ``rows`` in full per-worker batches."""
    per_worker = max(1, cfg.train.batch_size // cfg.train.num_workers)
    steps = rows // cfg.train.num_workers // per_worker
    return min(steps, cfg.train.max_steps_per_epoch) if cfg.train.max_steps_per_epoch is not None else steps


def check_labels_for_method(cfg: Config, manifest) -> None:
    """A supervised method refuses unlabeled datasets, naming them and what to do instead."""
    from puma.data.splits import unlabeled_datasets

    unlabeled = unlabeled_datasets(manifest, cfg.data.datasets)
    if unlabeled and get_method(cfg.model.method).needs_labels:
        label_free = sorted(name for name, m in METHODS.items() if not m.needs_labels)
        raise ConfigError(f"model.method={cfg.model.method!r} trains on labels, but dataset(s) {unlabeled} "
                          f"in {manifest.uri} have none (prepared as an unlabeled catalogue); train them "
                          f"with a label-free method {label_free} or leave them out with data.datasets")


def check_inputs(cfg: Config) -> Config:
    """What the workers will need, checked on the driver before any of them (or Ray) starts: the
    method's config checks, the backbone weights file, and the model built once from the config (so
    what only a built backbone can refuse, e.g. prompt layers or adapter blocks beyond its depth,
    fails here in one line, not in a worker). Returns the config with absolute paths."""
    from puma.methods import build_model
    from puma.models.backbone import check_weights_file

    cfg = for_this_process(cfg)
    check_config(cfg)
    check_weights_file(cfg.model.backbone.weights)
    model = build_model(cfg.model)  # a few seconds for a ViT-S on CPU; the model itself is not kept
    check_worker_build(cfg, model)
    return cfg


CHECK_CLASSES = 2  # the classes the driver's check builds a loss for (the data's count is not known yet)


def check_worker_build(cfg: Config, model) -> None:
    """Build on the driver what every worker builds from the config besides the model: the method's
    data-driven starts (on copies, with stand-in statistics), the method's train module with its loss,
    the optimiser over the trainable groups and its schedule. A config they refuse (e.g.
    loss.xbm_memory_size with a proxy loss, a PCA head wider than the features) fails here as a
    ConfigError, one line, instead of as a traceback in every worker."""
    from puma.methods import build_method_training
    from puma.models.trainable import trainable_parameter_groups
    from puma.optim import build_optimizer, build_scheduler

    try:
        check_data_init(cfg, model)
        method = build_method_training(cfg, model, CHECK_CLASSES)
        optimizer = build_optimizer(trainable_parameter_groups(model), method.module.loss, cfg.optim)
        build_scheduler(optimizer, cfg.optim)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, UserError):
            raise
        raise ConfigError(str(exc).splitlines()[0]) from exc


def run_training(cfg: Config, callbacks: list | None = None) -> TrainOutcome:
    """Fit PUMA with Ray Train; re-running the same run name continues from its newest complete
    checkpoint, and so does a worker group Ray restarts after a lost worker (puma/train/recovery.py).

    ``callbacks`` are Ray Train callbacks, e.g. Tune's TuneReportCallback inside a sweep trial
    (a trial restored by ``Tuner.restore`` re-runs this with its run name: the same rule applies).
    """
    cfg = check_inputs(cfg)  # a config or input the workers cannot use fails here, before any starts
    ray.data.DataContext.get_current().enable_progress_bars = False  # per-epoch lines come from the loop
    datasets, info = build_datasets(cfg)
    if "eval_skipped" in info and cfg.train.eval_every > 0:
        print(f"[puma] training-time evaluation skipped: {info['eval_skipped']}", flush=True)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_every=0))
    run = RunFolder.of(cfg)
    uri = run.uri
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": to_dict(cfg), "run_uri": uri, **info},
        scaling_config=scaling_config(cfg), run_config=run_config(cfg, callbacks), datasets=datasets,
        dataset_config=data_config(cfg))
    result = trainer.fit()
    last, metrics = _last_checkpoint(run, result)
    best = run.best
    if last is not None and not has_checkpoint(best):
        best = last  # nothing evaluated (e.g. an unlabeled catalogue): the last checkpoint is the result
    return TrainOutcome(run_uri=uri, best_checkpoint=best, last_checkpoint=last, metrics=metrics)


def _last_checkpoint(run: RunFolder, result) -> tuple[str | None, dict[str, Any]]:
    """The run's newest complete checkpoint and its metrics: Ray's, unless the run folder holds a newer
    one (a re-run that found every epoch done reports nothing new, and Ray's may lag storage)."""
    metrics = dict(result.metrics or {})
    last = run.child(result.checkpoint.path) if result.checkpoint is not None else None
    newest = newest_complete(run.uri)
    if newest is not None and newest.epoch > metrics.get("epoch", 0):
        return newest.uri, read_meta(newest.uri).get("metrics", {})
    return last, metrics
