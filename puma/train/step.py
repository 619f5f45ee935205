"""One PUMA training step on the global batch; torch.distributed only, no Ray.

The model and the loss know nothing of ranks. ``TrainModule`` joins them so that DDP covers the
loss proxies too, and gathers embeddings and labels across workers so the loss sees the global
batch (DESIGN.md section 1).
"""

from __future__ import annotations

import importlib
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _GatherWithGrad(torch.autograd.Function):
    """All-gather forward; backward sums the global gradient over ranks and keeps this rank's rows.

    Every rank computes the same loss on the global batch, so the gradient of this rank's rows is
    the sum over ranks of their gradient w.r.t. those rows (all_reduce works on gloo and NCCL).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # (B, ...) -> (W*B, ...)
        world, rank = dist.get_world_size(), dist.get_rank()
        ctx.rows, ctx.rank = x.shape[0], rank
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # (W*B, ...) -> (B, ...)
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows]


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """All-gather ``x`` (B, ...) -> (W*B, ...) along dim 0, keeping the autograd graph.

    Every rank must pass the same B (Ray Train's equal split and drop_last guarantee it).
    """
    if not is_distributed():
        return x
    return _GatherWithGrad.apply(x)


def gather_labels(labels: torch.Tensor) -> torch.Tensor:
    """All-gather integer labels (no gradient)."""
    if not is_distributed():
        return labels
    parts = [torch.empty_like(labels) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, labels.contiguous())
    return torch.cat(parts, dim=0)


class TrainModule(nn.Module):
    """Model + loss in one module (one DDP wrapper covers the proxies); loss on the global batch."""

    def __init__(self, model: nn.Module, loss: nn.Module):
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        emb = self.model(images)  # (B_local, E)
        emb_all = gather_with_grad(emb.float())  # (B_global, E)
        labels_all = gather_labels(labels)  # (B_global,)
        metric_loss = self.loss(emb_all, labels_all)
        aux = self.model.aux_loss()
        return {"loss": metric_loss + aux, "metric_loss": metric_loss.detach(), "aux_loss": aux.detach()}

    def after_backward(self, optimizer: torch.optim.Optimizer, clip_value: float, grad_scale: float) -> None:
        """Hook after backward and clipping, before the optimiser step (state outside DDP); none here."""


# Methods with a train module of their own: model.method -> "module:builder(cfg, model, num_classes)".
TRAIN_MODULES: dict[str, str] = {"vptsp_g": "puma.train.vptspg:build_vptspg_module"}


def build_train_module(cfg, model: nn.Module, num_classes: int) -> TrainModule:
    """``cfg.model.method``'s own train module, else model + ``build_loss(cfg.loss)`` in a TrainModule."""
    target = TRAIN_MODULES.get(cfg.model.method)
    if target is not None:
        module_name, builder = target.split(":")
        return getattr(importlib.import_module(module_name), builder)(cfg, model, num_classes)
    from puma.losses import build_loss

    return TrainModule(model, build_loss(cfg.loss, num_classes, cfg.model.head.embed_dim))


def autocast_context(device: torch.device, precision: str):
    """bf16/fp16 autocast on CUDA; full precision elsewhere."""
    if device.type != "cuda" or precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type="cuda", dtype=dtype)


def train_step(module: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor,
               labels: torch.Tensor, clip_value: float, precision: str = "fp32",
               scaler: torch.amp.GradScaler | None = None) -> dict[str, float]:
    """Forward on the global batch, backward, clip by value, step. Returns detached losses."""
    from puma.optim import clip_gradients

    optimizer.zero_grad(set_to_none=True)
    with autocast_context(images.device, precision):
        out = module(images, labels)
    loss = out["loss"]
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    else:
        loss.backward()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    clip_gradients(params, clip_value)
    getattr(module, "module", module).after_backward(optimizer, clip_value,
                                                     scaler.get_scale() if scaler is not None else 1.0)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return {k: float(v.detach()) for k, v in out.items()}
