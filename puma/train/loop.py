"""The Ray Train worker loop: the Ray-specific lines are here and in ``driver.py`` only."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.nn.functional as F

from puma import console, storage
from puma.checkpoint import (
    CheckpointError,
    CheckpointState,
    load_trainable,
    probe_embeddings,
    publish_best,
    read_checkpoint,
    save_checkpoint,
    verify_probe,
)
from puma.config import Config, from_dict, to_dict
from puma.data.device_views import batch_images, prefetched
from puma.distributed import sum_over_ranks
from puma.eval.embed import embed_batches
from puma.eval.metrics import evaluate_embeddings
from puma.faults import fault_hold
from puma.job_metrics import push_train
from puma.methods import TrainModule, build_method_training, build_model
from puma.models.trainable import trainable_parameter_groups, trainable_state_dict
from puma.optim import build_optimizer, build_scheduler, end_warmup_epoch, set_step_lr
from puma.run_folder import RunFolder, checkpoint_name, folder_name, version_label
from puma.train import recovery
from puma.train.data_init import needs_data_init, start_from_data
from puma.train.step import train_step

TRAIN_EVAL = "train_eval"  # the training images in the eval view, for methods that cluster them
_writers: dict[str, Any] = {}


@dataclass
class RunState:
    """What carries over between epochs and across a resume."""

    epoch: int = 0  # epochs completed
    step: int = 0
    best_value: float = float("-inf")  # train.best_metric of the model in best/
    best_epoch: int = 0  # the epoch that model finished (0: none yet)
    attempt: int = 1  # this attempt's number (each start of the workers is one: <run>/attempts/)
    resumes: int = 0  # how often this run restarted from a checkpoint (driver re-run or lost worker)
    recomputed_epochs: int = 0  # epochs written to storage once and trained again (0 is the goal)
    before: dict[str, float] = field(default_factory=dict)  # zero-shot metrics (frozen backbone)
    history: list[dict[str, float]] = field(default_factory=list)  # per epoch, with the attempt behind it


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Entry point of every Ray Train worker."""
    cfg: Config = from_dict(loop_config["config"])
    storage.configure(cfg.storage)
    torch.manual_seed(cfg.train.seed)
    device = ray.train.torch.get_device()
    model = build_model(cfg.model)
    method = build_method_training(cfg, model, loop_config["num_classes"])  # the method's record
    module, loss = method.module, method.module.loss
    optimizer = build_optimizer(trainable_parameter_groups(model), loss, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim)
    state, optimizer_state, retention = _resume(cfg, module.to(device), scheduler, loop_config["run_uri"])
    if state.step == 0 and needs_data_init(cfg):  # a fresh start (every rank agrees: rank 0's choice)
        _init_from_data(cfg, model, loss, device, loop_config["label_map"])
    module = ray.train.torch.prepare_model(module, parallel_strategy_kwargs={"broadcast_buffers": False})
    if optimizer_state is not None:  # after prepare_model: the state follows the parameters' device
        optimizer.load_state_dict(optimizer_state)
    scaler = torch.amp.GradScaler("cuda") if device.type == "cuda" and cfg.train.precision == "fp16" else None
    if not state.before and cfg.train.eval_every > 0 and cfg.train.eval_before:
        state.before = _evaluate_zero_shot(cfg, device, loop_config.get("eval_rows"))
    for epoch in range(state.epoch, cfg.train.epochs):
        stats = method.on_epoch_start(epoch, model, device,
                                      lambda: _batches(TRAIN_EVAL, cfg.eval.batch_size, drop_last=False))
        stats |= _train_epoch(cfg, module, optimizer, scheduler, scaler, device, epoch, state,
                              method.batch_labels, loop_config.get("steps_per_epoch"))
        end_warmup_epoch(optimizer, scheduler)
        scheduler.step()
        state.epoch = epoch + 1
        metrics = _epoch_metrics(cfg, module, device, state, stats, optimizer, loop_config.get("eval_rows"))
        _report(cfg, module, optimizer, scheduler, state, metrics, loop_config, retention)


def _is_rank0() -> bool:
    return ray.train.get_context().get_world_rank() == 0


def _log(msg: str) -> None:
    if _is_rank0():
        console.say(msg)  # not print(): Ray Train's print patch would send it to the driver twice


def _resume(cfg: Config, module: TrainModule, scheduler,
            run_uri: str) -> tuple[RunState, dict | None, recovery.Retention]:
    """Continue from the newest complete checkpoint of the run (rank 0 decides, every rank loads it).

    Ray's own checkpoint can lag the run folder by up to two checkpoints (puma/train/recovery.py
    explains why), so rank 0 lists the folder itself; its choice is broadcast so all ranks agree.
    """
    from ray.train.collective import broadcast_from_rank_zero

    plan, ckpt, retention = None, None, recovery.Retention(cfg.train.checkpoints_to_keep)
    workers = _worker_placement()  # every rank takes part
    if _is_rank0():
        plan, ckpt, retention.behind = _plan_on_rank0(cfg, module, run_uri, workers)
    choice = broadcast_from_rank_zero(None if plan is None else {
        "source": plan.source.uri if plan.source else None, "attempt": plan.attempt,
        "recomputed": plan.recomputed})
    if not _is_rank0() and choice["source"] is not None:
        ckpt = read_checkpoint(choice["source"], with_optimizer=True)
        _load_state(module, ckpt, choice["source"])
    state = RunState(**ckpt.meta["run_state"]) if ckpt is not None else RunState()
    state.attempt = choice["attempt"]
    if ckpt is not None:
        scheduler.load_state_dict(ckpt.meta["scheduler"])
        state.resumes += 1
        state.recomputed_epochs += choice["recomputed"]
    if _is_rank0():
        _reconcile_best(cfg, run_uri, state, ckpt)
    return state, (ckpt.optimizer if ckpt is not None else None), retention


def _worker_placement() -> list[dict]:
    """Each rank's Ray node id, host and pid, gathered on every rank (recorded with the attempt)."""
    import socket

    import torch.distributed as dist

    me = {"rank": ray.train.get_context().get_world_rank(), "host": socket.gethostname(), "pid": os.getpid(),
          "node_id": ray.get_runtime_context().get_node_id()}
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [me]
    everyone: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, me)
    return everyone


def _plan_on_rank0(cfg: Config, module: TrainModule, run_uri: str, workers: list[dict]):
    """Choose (and load) the checkpoint to continue from, record the attempt, clean up, log it."""
    from ray.train import CheckpointConsistencyMode

    ray_checkpoint = ray.train.get_checkpoint()
    ray_name = folder_name(ray_checkpoint.path) if ray_checkpoint is not None else None
    reported = ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED,
                                                       timeout_s=60)
    registered = {folder_name(r.checkpoint.path) for r in reported}

    def load(uri: str) -> CheckpointState:
        ckpt = read_checkpoint(uri, with_optimizer=True)
        _load_state(module, ckpt, uri)
        verify_probe(module.model, ckpt.meta, cfg.model.backbone.img_size, uri)
        return ckpt

    plan, ckpt = recovery.plan_resume(run_uri, ray_name, registered, load)
    plan.workers = workers
    recovery.record_attempt(plan)
    for line in recovery.plan_summary(plan):
        _log(line)
    for name in recovery.remove_incomplete(plan, registered):
        _log(f"removed incomplete checkpoint folder {name}")
    return plan, ckpt, plan.behind


def _load_state(module: TrainModule, ckpt: CheckpointState, source: str) -> None:
    """Trainable weights and loss state of ``ckpt`` into ``module`` (CheckpointError if they do not fit)."""
    load_trainable(module.model, ckpt.model, source=source)
    try:
        module.loss.load_state_dict(ckpt.loss)
    except RuntimeError as exc:
        raise CheckpointError(f"checkpoint {source}: its loss state does not fit this run's loss "
                              f"({exc})") from exc


def _reconcile_best(cfg: Config, run_uri: str, state: RunState, ckpt: CheckpointState | None) -> None:
    """Carry on with the best value and epoch of the model in best/ (finishing a cut-off best/ write)."""
    best = recovery.reconcile_best(RunFolder(run_uri).best, cfg.train.best_metric, state.best_value,
                                   state.best_epoch, ckpt, version_label(state.epoch, state.attempt))
    state.best_value, state.best_epoch = best.value, best.epoch
    if best.published:
        _log(f"best/ was behind its checkpoint: published epoch {best.epoch} "
             f"({cfg.train.best_metric} {best.value:.4f})")
    if best.unreadable:
        _log(f"best/ is unreadable ({best.unreadable}); the next evaluated epoch replaces it")


def _init_from_data(cfg: Config, model, loss, device, label_map: dict[str, int]) -> None:
    """The pool's centre and keys, then the PCA head and/or centroid proxies, from the training images
    (eval view; a pass each)."""
    def global_labels(batch: dict) -> np.ndarray:  # (dataset, label within it) -> training class id
        pairs = zip(batch["dataset"], batch["label"], strict=True)
        return np.array([label_map[f"{d}/{c}"] for d, c in pairs])

    def images():  # a new pass over the training images
        return _batches(TRAIN_EVAL, cfg.eval.batch_size, drop_last=False)

    done = start_from_data(cfg, model.to(device), loss.to(device), images, device, global_labels,
                           reduce=sum_over_ranks)
    parts = []
    if "init/pool_queries" in done:
        parts.append(f"prompt pool from the queries of {int(done['init/pool_queries'])} images")
    if "init/images" in done:
        parts.append(f"PCA head from {int(done['init/images'])} images")
    if "init/proxies" in done:
        parts.append(f"proxies at the centroids of {int(done['init/proxies'])} classes")
    _log("initialised from the training data: " + ", ".join(parts))


def _batches(split: str, batch_size: int, drop_last: bool, **options):
    shard = ray.train.get_dataset_shard(split)
    return shard.iter_batches(batch_size=batch_size, batch_format="numpy", drop_last=drop_last, **options)


def _train_epoch(cfg: Config, module, optimizer, scheduler, scaler, device, epoch: int, state: RunState,
                 batch_labels, steps: int | None = None) -> dict:
    """One pass over this worker's shard of the training stream (``steps``: expected, for progress)."""
    world = ray.train.get_context().get_world_size()
    per_worker = max(1, cfg.train.batch_size // world)
    module.train()
    losses, parts, seen, start = [], {}, 0, time.perf_counter()
    from puma.data.pipeline import iter_options

    bar = console.progress(f"epoch {epoch + 1}/{cfg.train.epochs}", steps, "steps", "img", show=_is_rank0())
    batches = _batches("train", per_worker, drop_last=True, **iter_options(cfg, epoch))
    with contextlib.closing(_model_inputs(cfg, batches, device)) as pairs:  # closing: stops a prefetch thread
        for i, (batch, images) in enumerate(pairs):  # images: (B, 3, H, W) on the device
            if cfg.train.max_steps_per_epoch is not None and i >= cfg.train.max_steps_per_epoch:
                break
            labels = torch.as_tensor(batch_labels(batch), device=device, dtype=torch.long)  # (B,)
            set_step_lr(optimizer, scheduler, state.step, cfg.optim.warmup_steps)
            out = train_step(module, optimizer, images, labels, cfg.optim.clip_value, cfg.train.precision,
                             scaler)
            losses.append(out["loss"])
            for key, value in out.items():
                parts.setdefault(key, []).append(value)
            seen += len(labels) * world
            state.step += 1
            bar.update(1, items=len(labels) * world, note=f"loss {np.mean(losses[-10:]):.4f}")
    bar.close()
    elapsed = time.perf_counter() - start
    return {**{f"train/{k}": float(np.mean(v)) for k, v in parts.items()},
            "train/loss": float(np.mean(losses)) if losses else float("nan"),
            "train/samples_per_s": seen / elapsed if elapsed > 0 else 0.0, "train/steps": len(losses),
            "train/step_seconds": elapsed / len(losses) if losses else 0.0}


def _model_inputs(cfg: Config, batches, device):
    """(batch, its images on the device) per batch; with data.decode_on=worker the next batches are
    decoded in a background thread while the current step runs (device_views.prefetched)."""
    if cfg.data.decode_on == "worker":
        return prefetched(batches, device)
    return ((batch, batch_images(batch, device)) for batch in batches)


def _evaluate(cfg: Config, embed_fn, device, label: str = "evaluation",
              rows: int | None = None) -> dict[str, float]:
    """Per-dataset, unified and harmonic metrics on rank 0 over the full evaluation split."""
    if not _is_rank0():
        return {}
    with console.progress(label, rows, "img") as bar:
        embedded = embed_batches(embed_fn, _batches("eval", cfg.eval.batch_size, drop_last=False), device,
                                 on_batch=bar.update)
    return evaluate_embeddings(embedded.embeddings, embedded.labels, embedded.datasets, embedded.roles,
                               ks=cfg.eval.ks, chunk=cfg.eval.query_chunk)


def _evaluate_zero_shot(cfg: Config, device, rows: int | None = None) -> dict[str, float]:
    """The frozen backbone's own features (final-norm CLS, L2-normalised): the 'before' baseline."""
    if not _is_rank0():
        return {}
    base = from_dict(to_dict(cfg))
    base.model.method = "linear"  # backbone + head only: no adapters, prompts or LoRA
    base.model.adapter.enabled = False
    base.model.prompt_pool.enabled = False
    backbone = build_model(base.model).to(device).eval()
    metrics = _evaluate(cfg, lambda x: F.normalize(backbone.forward_features(x), dim=-1), device,
                        "evaluation (frozen backbone)", rows)
    _log("before training (frozen backbone): " + _summary(metrics))
    return metrics


def _summary(metrics: dict[str, float], key: str = "r@1") -> str:
    return ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()) if k.endswith(f"/{key}"))


def _epoch_metrics(cfg: Config, module, device, state: RunState, stats: dict, optimizer,
                   eval_rows: int | None = None) -> dict:
    """Training statistics plus evaluation metrics when due."""
    metrics = {"epoch": state.epoch, "step": state.step, **stats,
               "lr/" + optimizer.param_groups[0].get("name", "0"): optimizer.param_groups[0]["lr"]}
    due = cfg.train.eval_every > 0 and (state.epoch % cfg.train.eval_every == 0
                                        or state.epoch == cfg.train.epochs)
    if due:
        model = getattr(module, "module", module).model
        model.eval()
        evaluated = _evaluate(cfg, model, device, f"evaluation after epoch {state.epoch}", eval_rows)
        metrics.update(evaluated)
        _log(f"epoch {state.epoch}: loss {stats['train/loss']:.4f}, " + _summary(evaluated))
    return metrics


def _report(cfg: Config, module, optimizer, scheduler, state: RunState, metrics: dict, loop_config,
            retention: recovery.Retention) -> None:
    """Checkpoint on rank 0 (trainable weights only), then best/ if it improved, then report to Ray Train.

    The checkpoint is complete on storage when ``ray.train.report`` returns (Ray registers it a
    poll later); best/ is published only after it, so a crash between the two is repaired on resume.
    """
    value = metrics.get(cfg.train.best_metric)
    improved = value is not None and value > state.best_value
    if improved:
        state.best_value, state.best_epoch = float(value), state.epoch
    state.history.append({**{k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
                          "attempt": state.attempt})
    metrics = {**metrics, "best/" + cfg.train.best_metric: state.best_value, "best/epoch": state.best_epoch,
               "run/attempt": state.attempt, "run/resumes": state.resumes,
               "run/recomputed_epochs": state.recomputed_epochs,
               **{f"before/{k}": v for k, v in state.before.items()}}
    name = checkpoint_name(state.epoch, state.attempt)
    if not _is_rank0():
        ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=name)
        return
    inner = getattr(module, "module", module)
    ckpt = CheckpointState(
        config=from_dict(loop_config["config"]), model=trainable_state_dict(inner.model),
        loss=inner.loss.state_dict(), optimizer=optimizer.state_dict(),
        meta={"epoch": state.epoch, "metrics": metrics, "label_map": loop_config["label_map"],
              "scheduler": scheduler.state_dict(), "run_state": state.__dict__,
              "backbone_weights": cfg.model.backbone.weights,
              "probe": probe_embeddings(inner.model, cfg.model.backbone.img_size)})
    _write_tensorboard(loop_config, metrics, state.epoch)
    push_train(cfg.metrics, cfg.train.run_name, metrics)  # metrics.pushgateway, when set
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(tmp, ckpt)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                         checkpoint_dir_name=name)
    fault_hold("train.checkpoint")  # kill tests: complete on storage, best/ and the next epoch not yet
    if improved:
        best_uri = RunFolder(loop_config["run_uri"]).best
        publish_best(best_uri, ckpt, version_label(state.epoch, state.attempt))
    for uri in retention.after_checkpoint():
        _log(f"removed {folder_name(uri)}: an earlier attempt's checkpoint Ray never registered "
             f"(train.checkpoints_to_keep={cfg.train.checkpoints_to_keep})")


def _write_tensorboard(loop_config: dict, metrics: dict, epoch: int) -> None:
    """Scalars for TensorBoard in the run's tensorboard/ (an s3:// run's are staged in a local folder of
    its own, then uploaded)."""
    from torch.utils.tensorboard import SummaryWriter

    run = RunFolder(loop_config["run_uri"])
    on_s3 = storage.is_s3(run.uri)
    local = run.tensorboard_staging() if on_s3 else run.tensorboard
    if local not in _writers:
        if on_s3:  # what an earlier process staged is on S3 already (or from a deleted run)
            shutil.rmtree(local, ignore_errors=True)
        _writers[local] = SummaryWriter(log_dir=local)
    writer = _writers[local]
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and np.isfinite(value):
            writer.add_scalar(key, value, epoch)
    writer.flush()
    if on_s3:
        for path in storage.list_files(local):
            storage.write_bytes(storage.join(run.tensorboard, os.path.relpath(path, local)),
                                storage.read_bytes(path))
