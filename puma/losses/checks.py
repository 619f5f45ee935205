"""What every loss checks of its inputs (torch only: importable without pytorch-metric-learning)."""

from __future__ import annotations

import torch


class LossInputError(ValueError):
    """Embeddings or labels given to a loss do not fit it; the message says what arrived."""


def check_embeddings_labels(embeddings: torch.Tensor, labels: torch.Tensor,
                            embedding_size: int | None = None, num_classes: int | None = None) -> None:
    """Raise LossInputError unless embeddings is (B, E) float and labels is (B,) int in [0, num_classes)."""
    if not torch.is_tensor(embeddings) or embeddings.ndim != 2 or not embeddings.is_floating_point():
        got = tuple(embeddings.shape) if torch.is_tensor(embeddings) else type(embeddings).__name__
        raise LossInputError(f"embeddings must be a float tensor of shape (batch, embedding_size); got {got}")
    if embedding_size is not None and embeddings.shape[1] != embedding_size:
        raise LossInputError(f"embeddings have size {embeddings.shape[1]}; "
                             f"this loss expects {embedding_size}")
    if not torch.is_tensor(labels) or labels.ndim != 1 or labels.is_floating_point() or labels.is_complex():
        got = f"{labels.dtype} {tuple(labels.shape)}" if torch.is_tensor(labels) else type(labels).__name__
        raise LossInputError(f"labels must be an integer tensor of shape (batch,); got {got}")
    if labels.shape[0] != embeddings.shape[0]:
        raise LossInputError(f"got {embeddings.shape[0]} embeddings but {labels.shape[0]} labels")
    if num_classes is not None:
        bad = (labels < 0) | (labels >= num_classes)
        if bool(bad.any()):
            raise LossInputError(f"labels must lie in [0, {num_classes}); got {labels[bad][:8].tolist()} "
                                 f"(the loss was built for {num_classes} classes)")
