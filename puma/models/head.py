"""The embedding heads: Linear(D -> embed_dim) on the final-norm CLS token, then L2 normalisation.

The MLP-3 head (method mlp3, PUMA Table 2(c) "MLP-3 Emb.") follows the released code: Linear(D, 2048)
- GELU - Linear(2048, 2048) - GELU - Linear(2048, 128), no normalisation layers (5.25M parameters at
ViT-S).
"""

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


MLP_HIDDEN_DIM = 2048
MLP_LAYERS = 3


class MlpEmbeddingHead(EmbeddingHead):
    """(B, D) -> Linear-GELU x (layers - 1) -> Linear ``proj`` -> L2 normalise -> (B, embed_dim)."""

    def __init__(self, dim: int, embed_dim: int, hidden_dim: int = MLP_HIDDEN_DIM, layers: int = MLP_LAYERS):
        super().__init__(hidden_dim, embed_dim)  # proj: Linear(hidden_dim -> embed_dim), the last layer
        if layers < 2:
            raise ValueError(f"an MLP head needs layers >= 2 (1 is the linear head); got {layers}")
        widths = [dim] + [hidden_dim] * (layers - 1)
        hidden: list[nn.Module] = []
        for w_in, w_out in zip(widths[:-1], widths[1:], strict=True):
            hidden += [nn.Linear(w_in, w_out), nn.GELU()]
        self.mlp = nn.Sequential(*hidden)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return super().forward(self.mlp(features))  # (B, D) -> (B, hidden) -> (B, E)
