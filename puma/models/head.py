"""The embedding heads: Linear(D -> embed_dim) on the final-norm CLS token, then L2 normalisation.

The MLP-3 head (method mlp3, PUMA Table 2(c) "MLP-3 Emb.") follows the released code: Linear(D, 2048)
- GELU - Linear(2048, 2048) - GELU - Linear(2048, 128), no normalisation layers (5.25M parameters at
ViT-S).

``model.head.init`` (HeadConfig) chooses the linear head's starting point:

- ``random``: nn.Linear's default initialisation (the released code's);
- ``pca``: the projection onto the top-``embed_dim`` principal directions of the model's own
  initial features of the training images, centred on their mean (``init_from_features``), so the
  first step starts from the frozen backbone's retrieval quality instead of a random projection of it.
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

    @torch.no_grad()
    def init_from_features(self, mean: torch.Tensor, cov: torch.Tensor) -> None:
        """PCA init from feature statistics: mean (D,), covariance (D, D); x -> U^T (x - mean)."""
        dim, embed_dim = self.proj.in_features, self.proj.out_features
        if mean.shape != (dim,) or cov.shape != (dim, dim):
            raise ValueError(f"feature statistics must be mean ({dim},) and covariance ({dim}, {dim}); "
                             f"got {tuple(mean.shape)} and {tuple(cov.shape)}")
        if embed_dim > dim:
            raise ValueError(f"PCA init needs embed_dim <= the feature width; got {embed_dim} > {dim}")
        top = principal_directions(cov, embed_dim)  # (E, D)
        self.proj.weight.copy_(top.to(self.proj.weight))
        self.proj.bias.copy_((-top @ mean.double()).to(self.proj.bias))


def principal_directions(cov: torch.Tensor, k: int) -> torch.Tensor:
    """The top-``k`` eigenvectors of ``cov`` (D, D) as rows (k, D), float64, largest variance first,
    each with a deterministic sign (its entries sum to >= 0)."""
    _, vectors = torch.linalg.eigh(cov.double())  # ascending eigenvalues
    top = vectors[:, -k:].flip(-1).T  # (k, D)
    return top * torch.sign(top.sum(1, keepdim=True) + 1e-30)


class FeatureMoments:
    """Running sums for the PCA init: count, sum x and sum x x^T of (B, D) features."""

    def __init__(self, dim: int) -> None:
        self.count = torch.zeros((), dtype=torch.float64)
        self.sum = torch.zeros(dim, dtype=torch.float64)
        self.outer = torch.zeros(dim, dim, dtype=torch.float64)

    def add(self, features: torch.Tensor) -> None:
        x = features.detach().to(torch.float64).cpu()  # (B, D)
        self.count += x.shape[0]
        self.sum += x.sum(0)
        self.outer += x.T @ x

    def tensors(self) -> list[torch.Tensor]:
        """The sums, for an all-reduce across workers (summed in place)."""
        return [self.count, self.sum, self.outer]

    def mean_cov(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.count < 2:
            raise ValueError(f"PCA init needs at least 2 training images; got {int(self.count)}")
        mean = self.sum / self.count
        return mean, self.outer / self.count - torch.outer(mean, mean)

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
