"""The Ray Train worker loop: the Ray-specific lines are here and in ``driver.py`` only."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.nn.functional as F

from puma import storage
from puma.checkpoint import (
    BEST_DIR,
    CheckpointState,
    load_trainable,
    probe_embeddings,
    read_checkpoint,
    save_checkpoint,
)
from puma.config import Config, from_dict, to_dict
from puma.eval.embed import embed_batches
from puma.eval.metrics import evaluate_embeddings
from puma.methods import TrainModule, build_method_training, build_model
from puma.models.trainable import trainable_parameter_groups, trainable_state_dict
from puma.optim import build_optimizer, build_scheduler
from puma.train.step import train_step

TRAIN_EVAL = "train_eval"  # the training images in the eval view, for methods that cluster them
_writers: dict[str, Any] = {}


@dataclass
class RunState:
    """What carries over between epochs and across a resume."""

    epoch: int = 0  # epochs completed
    step: int = 0
    best_value: float = float("-inf")
    resumes: int = 0  # how often this run restarted from a checkpoint (driver re-run or lost worker)
    before: dict[str, float] = field(default_factory=dict)  # zero-shot metrics (frozen backbone)
    history: list[dict[str, float]] = field(default_factory=list)


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
    state, optimizer_state = _maybe_resume(module, scheduler)
    module = ray.train.torch.prepare_model(module, parallel_strategy_kwargs={"broadcast_buffers": False})
    if optimizer_state is not None:  # after prepare_model: the state follows the parameters' device
        optimizer.load_state_dict(optimizer_state)
    scaler = torch.amp.GradScaler("cuda") if device.type == "cuda" and cfg.train.precision == "fp16" else None
    if not state.before and cfg.train.eval_every > 0 and cfg.train.eval_before:
        state.before = _evaluate_zero_shot(cfg, device)
    for epoch in range(state.epoch, cfg.train.epochs):
        stats = method.on_epoch_start(epoch, model, device,
                                      lambda: _batches(TRAIN_EVAL, cfg.eval.batch_size, drop_last=False))
        stats |= _train_epoch(cfg, module, optimizer, scaler, device, epoch, state, method.batch_labels)
        scheduler.step()
        state.epoch = epoch + 1
        metrics = _epoch_metrics(cfg, module, device, state, stats, optimizer)
        _report(cfg, module, optimizer, scheduler, state, metrics, loop_config)


def _is_rank0() -> bool:
    return ray.train.get_context().get_world_rank() == 0


def _log(msg: str) -> None:
    if _is_rank0():
        print(f"[puma] {msg}", flush=True)


def _maybe_resume(module: TrainModule, scheduler) -> tuple[RunState, dict | None]:
    """Restore weights, schedule and run state from Ray's latest checkpoint, if any."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return RunState(), None
    where = storage.display_uri(checkpoint.path, checkpoint.filesystem)
    with checkpoint.as_directory() as path:
        ckpt = read_checkpoint(path, with_optimizer=True)
    load_trainable(module.model, ckpt.model, source=where)
    module.loss.load_state_dict(ckpt.loss)
    scheduler.load_state_dict(ckpt.meta["scheduler"])
    state = RunState(**ckpt.meta["run_state"])
    state.resumes += 1
    _log(f"resumed from {where} after epoch {state.epoch} (step {state.step})")
    return state, ckpt.optimizer


def _batches(split: str, batch_size: int, drop_last: bool, **options):
    shard = ray.train.get_dataset_shard(split)
    return shard.iter_batches(batch_size=batch_size, batch_format="numpy", drop_last=drop_last, **options)


def _train_epoch(cfg: Config, module, optimizer, scaler, device, epoch: int, state: RunState,
                 batch_labels) -> dict:
    """One pass over this worker's shard of the training stream."""
    world = ray.train.get_context().get_world_size()
    per_worker = max(1, cfg.train.batch_size // world)
    module.train()
    losses, parts, seen, start = [], {}, 0, time.perf_counter()
    from puma.data.pipeline import iter_options

    for i, batch in enumerate(_batches("train", per_worker, drop_last=True, **iter_options(cfg, epoch))):
        if cfg.train.max_steps_per_epoch is not None and i >= cfg.train.max_steps_per_epoch:
            break
        images = torch.as_tensor(batch["image"], device=device)  # (B, 3, H, W)
        labels = torch.as_tensor(batch_labels(batch), device=device, dtype=torch.long)  # (B,)
        out = train_step(module, optimizer, images, labels, cfg.optim.clip_value, cfg.train.precision, scaler)
        losses.append(out["loss"])
        for key, value in out.items():
            parts.setdefault(key, []).append(value)
        seen += len(labels) * world
        state.step += 1
        if state.step % 10 == 0:
            _log(f"epoch {epoch + 1} step {state.step} loss {np.mean(losses[-10:]):.4f}")
    elapsed = time.perf_counter() - start
    return {**{f"train/{k}": float(np.mean(v)) for k, v in parts.items()},
            "train/loss": float(np.mean(losses)) if losses else float("nan"),
            "train/samples_per_s": seen / elapsed if elapsed > 0 else 0.0, "train/steps": len(losses)}


def _evaluate(cfg: Config, embed_fn, device) -> dict[str, float]:
    """Per-dataset, unified and harmonic metrics on rank 0 over the full evaluation split."""
    if not _is_rank0():
        return {}
    embedded = embed_batches(embed_fn, _batches("eval", cfg.eval.batch_size, drop_last=False), device)
    return evaluate_embeddings(embedded.embeddings, embedded.labels, embedded.datasets, embedded.roles,
                               ks=cfg.eval.ks, chunk=cfg.eval.query_chunk)


def _evaluate_zero_shot(cfg: Config, device) -> dict[str, float]:
    """The frozen backbone's own features (final-norm CLS, L2-normalised): the 'before' baseline."""
    if not _is_rank0():
        return {}
    base = from_dict(to_dict(cfg))
    base.model.method = "linear"  # backbone + head only: no adapters, prompts or LoRA
    base.model.adapter.enabled = False
    base.model.prompt_pool.enabled = False
    backbone = build_model(base.model).to(device).eval()
    metrics = _evaluate(cfg, lambda x: F.normalize(backbone.forward_features(x), dim=-1), device)
    _log("before training (frozen backbone): " + _summary(metrics))
    return metrics


def _summary(metrics: dict[str, float], key: str = "r@1") -> str:
    return ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()) if k.endswith(f"/{key}"))


def _epoch_metrics(cfg: Config, module, device, state: RunState, stats: dict, optimizer) -> dict:
    """Training statistics plus evaluation metrics when due."""
    metrics = {"epoch": state.epoch, "step": state.step, **stats,
               "lr/" + optimizer.param_groups[0].get("name", "0"): optimizer.param_groups[0]["lr"]}
    due = cfg.train.eval_every > 0 and (state.epoch % cfg.train.eval_every == 0
                                        or state.epoch == cfg.train.epochs)
    if due:
        model = getattr(module, "module", module).model
        model.eval()
        evaluated = _evaluate(cfg, model, device)
        metrics.update(evaluated)
        _log(f"epoch {state.epoch}: loss {stats['train/loss']:.4f}, " + _summary(evaluated))
    return metrics


def _report(cfg: Config, module, optimizer, scheduler, state: RunState, metrics: dict, loop_config) -> None:
    """Checkpoint on rank 0 (trainable weights only), keep the best copy, report to Ray Train."""
    value = metrics.get(cfg.train.best_metric)
    improved = value is not None and value > state.best_value
    if improved:
        state.best_value = float(value)
    state.history.append({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
    metrics = {**metrics, "best/" + cfg.train.best_metric: state.best_value,
               **{f"before/{k}": v for k, v in state.before.items()}}
    if not _is_rank0():
        ray.train.report(metrics, checkpoint=None)
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
    if improved:
        best = dict(ckpt.__dict__, optimizer=None)
        save_checkpoint(storage.join(loop_config["run_uri"], BEST_DIR), CheckpointState(**best))
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(tmp, ckpt)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def _write_tensorboard(loop_config: dict, metrics: dict, epoch: int) -> None:
    """Scalars for TensorBoard under <run>/tensorboard (written locally, then copied to S3 if needed)."""
    from torch.utils.tensorboard import SummaryWriter

    run_uri = loop_config["run_uri"]
    local = run_uri if not storage.is_s3(run_uri) else os.path.join(tempfile.gettempdir(), "puma-tb")
    if local not in _writers:
        _writers[local] = SummaryWriter(log_dir=os.path.join(local, "tensorboard"))
    writer = _writers[local]
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and np.isfinite(value):
            writer.add_scalar(key, value, epoch)
    writer.flush()
    if storage.is_s3(run_uri):
        for path in storage.list_files(os.path.join(local, "tensorboard")):
            rel = os.path.relpath(path, local)
            storage.write_bytes(storage.join(run_uri, rel), storage.read_bytes(path))

