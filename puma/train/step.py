"""One optimiser step of a train module on the global batch; torch only, no Ray.

The train module (``puma.methods.TrainModule`` or a method's own) computes the total loss on the
global batch (embeddings and labels gathered across workers, DESIGN.md section 1); this file runs
autocast, backward, clipping, the module's after-backward hook and the optimiser step.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from puma.optim import clip_gradients


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
