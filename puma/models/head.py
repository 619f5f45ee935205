"""The embedding head: Linear(D -> embed_dim) on the final-norm CLS token, then L2 normalisation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class EmbeddingHead(nn.Module):
    """(B, D) features -> (B, embed_dim) unit-length embeddings."""

    def __init__(self, dim: int, embed_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, embed_dim)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.proj(features), p=2, dim=-1)  # (B, D) -> (B, E)
