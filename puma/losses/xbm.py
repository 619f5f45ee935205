"""Cross-batch memory (XBM, Wang et al., CVPR 2020) around a pair-based loss (PUMA appendix Table 8).

pml's CrossBatchMemory keeps a FIFO queue of the last ``memory_size`` (detached) embeddings and
labels; each step enqueues the batch, then mines and computes the wrapped loss between the batch
and the whole queue (the batch's comparisons with itself removed). The queue is a pair of buffers
(``embedding_memory``, ``label_memory``), saved in the loss's state_dict. In this project the loss
sees the global batch (gathered across workers), so every worker's queue holds the same items.

The released PUMA code wraps Triplet and MS this way with a queue of 4096; the configs of Table 8
do the same. XBM's warm-up (no memory for the first iterations) is not applied.
"""

from __future__ import annotations

import torch
from pytorch_metric_learning.losses import CrossBatchMemory

from puma.losses.checks import LossInputError


class CrossBatchMemoryLoss(CrossBatchMemory):
    """CrossBatchMemory that refuses a batch larger than its queue with a clear error."""

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple=None,
                enqueue_mask=None) -> torch.Tensor:
        if enqueue_mask is None and len(embeddings) > self.memory_size:
            raise LossInputError(f"a (global) batch of {len(embeddings)} does not fit the cross-batch memory "
                                 f"of {self.memory_size}; set loss.xbm_memory_size >= the global batch size")
        return super().forward(embeddings, labels, indices_tuple, enqueue_mask)

    @property
    def filled(self) -> int:
        """How many items the queue holds now."""
        return self.memory_size if self.has_been_filled else self.queue_idx
