"""Embed an iterable of batches into arrays (no Ray): used by training-time evaluation and jobs."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from puma.config import ConfigError
from puma.data.device_views import batch_images


@dataclass
class EmbeddedSet:
    """Embeddings with the columns the metrics need, row-aligned."""

    embeddings: np.ndarray  # (N, E) float32
    labels: np.ndarray  # (N,) int64, class within its dataset
    datasets: np.ndarray  # (N,) str
    roles: np.ndarray  # (N,) str
    item_ids: np.ndarray  # (N,) str

    def __len__(self) -> int:
        return len(self.item_ids)


@torch.no_grad()
def embed_batches(embed_fn: Callable[[torch.Tensor], torch.Tensor], batches: Iterable[dict],
                  device: torch.device, on_batch: Callable[[int], None] | None = None) -> EmbeddedSet:
    """Run ``embed_fn`` over numpy batches with columns image, label, dataset, role, item_id;
    ``on_batch(rows)`` after each (progress)."""
    parts: dict[str, list] = {k: [] for k in ("embeddings", "labels", "datasets", "roles", "item_ids")}
    for batch in batches:
        images = batch_images(batch, device)  # (B, 3, H, W)
        parts["embeddings"].append(embed_fn(images).float().cpu().numpy())  # (B, E)
        parts["labels"].append(np.asarray(batch["label"], dtype=np.int64))
        parts["datasets"].append(np.asarray(batch["dataset"]).astype(str))
        parts["roles"].append(np.asarray(batch["role"]).astype(str))
        parts["item_ids"].append(np.asarray(batch["item_id"]).astype(str))
        if on_batch is not None:
            on_batch(len(images))
    if not parts["item_ids"]:
        raise ConfigError("no rows to embed: the evaluation dataset is empty (check data.uri and splits)")
    return EmbeddedSet(**{k: np.concatenate(v) for k, v in parts.items()})
