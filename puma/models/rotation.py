"""Rotation prediction (Gidaris et al. 2018), the self-supervised task of UDML-SS (paper section 3.4).

Each image is turned by k x 90 degrees, k in {0, 1, 2, 3} drawn per sample, and a 4-way linear head
h_theta3 on the backbone features f_theta1 predicts k (cross-entropy, Eq. 6).
"""

from __future__ import annotations

import torch
from torch import nn

NUM_ROTATIONS = 4  # 0, 90, 180, 270 degrees


class RotationHead(nn.Module):
    """Backbone features (B, D) -> rotation logits (B, 4): h_theta3 of the paper."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, NUM_ROTATIONS)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features)  # (B, D) -> (B, 4)


def draw_rotations(batch: int, generator: torch.Generator) -> torch.Tensor:
    """k (B,) int64 in {0, 1, 2, 3}, drawn uniformly from ``generator`` (on the CPU)."""
    return torch.randint(0, NUM_ROTATIONS, (batch,), generator=generator)


def rotate_images(images: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """Turn image i (B, C, S, S) counter-clockwise by turns[i] x 90 degrees (square images only)."""
    if images.shape[-1] != images.shape[-2]:
        raise ValueError(f"rotation prediction needs square images; got {tuple(images.shape[-2:])}")
    if turns.shape != images.shape[:1]:
        raise ValueError(f"turns {tuple(turns.shape)} must give one rotation per image ({images.shape[0]},)")
    out = images.clone()
    for k in range(1, NUM_ROTATIONS):
        idx = (turns == k).nonzero(as_tuple=True)[0].to(images.device)
        if len(idx):
            out[idx] = torch.rot90(images[idx], k, dims=(-2, -1))
    return out
