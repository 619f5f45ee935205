"""torch.distributed helpers for the training step: the only code that talks across ranks (no Ray).

Models and losses never call these. The train modules (puma.methods) gather embeddings and labels
so that the loss sees the global batch (DESIGN.md section 1); the class-prompt bank averages its
gradient and the pseudo-labels are broadcast from rank 0, so every rank holds the same state.
On one process every helper returns its input.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def is_distributed() -> bool:
    """True inside a process group of more than one rank."""
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


def average_over_ranks(grad: torch.Tensor) -> torch.Tensor:
    """The gradient averaged over ranks (each rank holds the same rows); unchanged on one process."""
    if not is_distributed():
        return grad
    grad = grad.clone()
    dist.all_reduce(grad)
    return grad / dist.get_world_size()


def sum_over_ranks(tensors: list[torch.Tensor]) -> None:
    """All-reduce (sum) each CPU tensor in place across ranks; nothing to do on one process.

    The tensors travel through the default device of the process group (NCCL needs CUDA tensors).
    """
    if not is_distributed():
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    for t in tensors:
        moved = t.to(device)
        dist.all_reduce(moved)
        t.copy_(moved.to(t.device))


def broadcast_object(obj: T) -> T:
    """``obj`` from rank 0 on every rank (itself when not distributed)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
