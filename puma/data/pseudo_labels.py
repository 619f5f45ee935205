"""k-means pseudo-labels for unsupervised metric learning (UDML-SS section 3.2); no Ray here.

At the start of training and every ``recluster_every`` epochs the training images are embedded
(eval view, no augmentation) by the current model and clustered by FAISS k-means, seeded; each
item_id gets its cluster as pseudo-label, and training batches look labels up by item_id. In a
multi-worker run rank 0 embeds and clusters and broadcasts the labels (torch.distributed), so
every rank trains on the same labels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import faiss
import numpy as np
import torch
import torch.distributed as dist

from puma.config import ConfigError
from puma.data.device_views import batch_images
from puma.distributed import broadcast_object, is_distributed


def kmeans_pseudo_labels(embeddings: np.ndarray, k: int, seed: int, niter: int = 20,
                         use_gpu: bool = True) -> np.ndarray:
    """Cluster ids (N,) int64 of FAISS k-means with ``k`` centroids on ``embeddings`` (N, E)."""
    x = np.ascontiguousarray(embeddings, dtype=np.float32)
    if x.ndim != 2 or len(x) < k:
        raise ConfigError(f"k-means with model.udml_ss.num_clusters={k} needs at least {k} embeddings; "
                         f"got {x.shape[0] if x.ndim else 0} training images (lower num_clusters)")
    gpu = use_gpu and faiss.get_num_gpus() > 0
    kmeans = faiss.Kmeans(x.shape[1], k, niter=niter, seed=seed, gpu=gpu, verbose=False)
    kmeans.train(x)
    _, assigned = kmeans.index.search(x, 1)  # (N, 1) nearest centroid
    return assigned[:, 0].astype(np.int64)


class PseudoLabels:
    """item_id -> pseudo-label, refreshed on a schedule; ``lookup`` serves training batches."""

    def __init__(self, num_clusters: int, recluster_every: int, seed: int, niter: int = 20,
                 use_gpu: bool = True) -> None:
        self.num_clusters = num_clusters
        self.recluster_every = recluster_every
        self.seed = seed
        self.niter = niter
        self.use_gpu = use_gpu
        self.labels: dict[str, int] = {}
        self.computed_at: list[int] = []  # epochs (0-based) whose start re-clustered, in this process

    def due(self, epoch: int) -> bool:
        """Re-cluster before ``epoch`` (0-based)? At epoch 0, every recluster_every-th, and on a resume."""
        return not self.labels or epoch % self.recluster_every == 0

    def refresh(self, epoch: int, embed: Callable[[], tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
        """If due: ``embed()`` -> (embeddings (N, E), item_ids (N,)) on rank 0, k-means, broadcast."""
        if not self.due(epoch):
            return {"pseudo_labels/reclustered": 0.0}
        mapping = None
        if not is_distributed() or dist.get_rank() == 0:
            embeddings, item_ids = embed()
            clusters = kmeans_pseudo_labels(embeddings, self.num_clusters, self.seed + epoch, self.niter,
                                            self.use_gpu)
            mapping = dict(zip((str(i) for i in item_ids), clusters.tolist(), strict=True))
            print(f"[puma] epoch {epoch + 1}: k-means pseudo-labels for {len(mapping)} training images, "
                  f"{len(np.unique(clusters))} of {self.num_clusters} clusters used", flush=True)
        self.labels = broadcast_object(mapping)
        self.computed_at.append(epoch)
        used = len(set(self.labels.values()))
        return {"pseudo_labels/reclustered": 1.0, "pseudo_labels/clusters": float(used),
                "pseudo_labels/items": float(len(self.labels))}

    def lookup(self, item_ids: Sequence[str] | np.ndarray) -> np.ndarray:
        """Pseudo-labels (B,) int64 of ``item_ids``; raises naming an item that was never clustered."""
        try:
            return np.fromiter((self.labels[str(i)] for i in item_ids), dtype=np.int64, count=len(item_ids))
        except KeyError as exc:
            raise ValueError(f"training item {exc.args[0]!r} has no pseudo-label: it was not in the "
                             f"clustered training stream ({len(self.labels)} items)") from exc


@torch.no_grad()
def embed_items(embed_fn: Callable[[torch.Tensor], torch.Tensor], batches: Iterable[dict],
                device: torch.device) -> tuple[np.ndarray, np.ndarray]:
    """(embeddings (N, E) float32, item_ids (N,)) of numpy batches with columns image and item_id."""
    embeddings, item_ids = [], []
    for batch in batches:
        images = batch_images(batch, device)  # (B, 3, H, W)
        embeddings.append(embed_fn(images).float().cpu().numpy())  # (B, E)
        item_ids.append(np.asarray(batch["item_id"]).astype(str))
    if not item_ids:
        raise ValueError("no training images to cluster: the training stream is empty")
    return np.concatenate(embeddings), np.concatenate(item_ids)
