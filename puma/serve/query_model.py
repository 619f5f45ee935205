"""The query model deployment: a query image's eval view (3, S, S) -> its embedding (E,), with the
checkpoint of the version the request is pinned to (puma.serve.versions). Images that arrive together
share one forward (@serve.batch); on a GPU when there is one.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
from ray import serve

from puma.data.images import ViewSpec, eval_view_spec
from puma.inference.embedder import Embedder
from puma.serve.metrics import ModelMetrics


@serve.deployment
class QueryModel:
    """Checkpoints' models (the live version's, and the one before it while a switch settles):
    eval views (3, S, S) -> embeddings (E,), batched across requests."""

    MODELS_KEPT = 2

    def __init__(self, checkpoint: str, backbone_weights: str, storage_cfg, use_gpu: bool, threads: int,
                 max_batch_size: int, batch_wait_timeout_s: float, min_image_size: int = 0,
                 runtime: str = "torch", metrics: bool = True) -> None:
        self.options = (backbone_weights, storage_cfg, use_gpu, threads, runtime)
        self.min_image_size = min_image_size
        self.embedders: dict[str, Embedder] = {}
        self._lock = threading.Lock()
        self.default = checkpoint
        self.load(checkpoint)
        self.embed.set_max_batch_size(max_batch_size)
        self.embed.set_batch_wait_timeout_s(batch_wait_timeout_s)
        self.batches, self.images, self.largest_batch = 0, 0, 0
        self.metrics = ModelMetrics(enabled=metrics)

    def load(self, checkpoint: str) -> Embedder:
        """The checkpoint's model, loaded once (the oldest of more than MODELS_KEPT dropped)."""
        with self._lock:
            if checkpoint not in self.embedders:
                self.embedders[checkpoint] = Embedder(checkpoint, *self.options)
                while len(self.embedders) > self.MODELS_KEPT:
                    self.embedders.pop(next(iter(self.embedders)))
            return self.embedders[checkpoint]

    async def prepare(self, checkpoint: str) -> ViewSpec:
        """Load ``checkpoint`` (off the event loop) and return its eval view for query images."""
        from puma.checkpoint import read_checkpoint

        await asyncio.get_running_loop().run_in_executor(None, self.load, checkpoint)
        state = await asyncio.get_running_loop().run_in_executor(None, read_checkpoint, checkpoint)
        return eval_view_spec(state.config, min_size=self.min_image_size)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def embed(self, views: list[np.ndarray], checkpoints: list[str]) -> list[np.ndarray]:
        """One forward per model for every view that arrived together: B x (3, S, S) -> B x (E,)."""
        out: list = [None] * len(views)
        loop = asyncio.get_running_loop()
        for checkpoint in dict.fromkeys(c or self.default for c in checkpoints):
            rows = [i for i, c in enumerate(checkpoints) if (c or self.default) == checkpoint]
            embedder = await loop.run_in_executor(None, self.load, checkpoint)
            batch = np.stack([views[i] for i in rows])  # (B, 3, S, S)
            emb = await loop.run_in_executor(None, embedder.forward, batch)  # (B, E)
            for i, e in zip(rows, emb, strict=True):
                out[i] = e
        self.batches, self.images = self.batches + 1, self.images + len(views)
        self.largest_batch = max(self.largest_batch, len(views))
        self.metrics.batch(len(views))
        return out

    def stats(self) -> dict:
        """Batches run, images embedded, the largest batch, the device, the models loaded (this replica)."""
        device = str(next(iter(self.embedders.values())).device) if self.embedders else ""
        return {"batches": self.batches, "images": self.images, "largest_batch": self.largest_batch,
                "device": device, "checkpoints": list(self.embedders), "runtime": self.options[4]}
