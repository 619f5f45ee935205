"""Hyp (Ermolov et al., CVPR 2022): the pairwise cross-entropy loss in the Poincare ball.

Embeddings are mapped into the ball of curvature -c as Hyp's ``ToPoincare`` head does (feature
clipping to norm <= clip_r, then the exponential map at 0, then a projection that keeps points
strictly inside the ball of radius 1 / sqrt(c)):

    x_c = x * min(1, clip_r / (||x|| + 1e-5))
    z   = tanh(sqrt(c) ||x_c||) x_c / (sqrt(c) ||x_c||)

and compared by the geodesic distance (equal to Hyp's 2 / sqrt(c) artanh(sqrt(c) ||-z_i (+)_c z_j||)):

    d(z_i, z_j) = arcosh(1 + 2 c ||z_i - z_j||^2 / ((1 - c ||z_i||^2) (1 - c ||z_j||^2))) / sqrt(c)

Hyp's loss for a positive pair (i, j) is a softmax over every other sample k != i of the batch:

    l_ij = -log( exp(-d_ij / tau) / sum_{k != i} exp(-d_ik / tau) )

Hyp draws two images per class, so each anchor has one positive; here the positives come from the
labels (any batch composition), and the loss is pml's SupConLoss with this distance: the mean over
anchors of the mean over their positives (equal to Hyp's loss with two images per class, averaged
over both directions). Settings are Hyp's: c = 0.1, clip_r = 2.3, tau = 0.2.

Our models output unit-length embeddings (the contract of every method and of the cosine / inner
product index), so every z lies on one sphere of the ball; there d is a monotone function of
||z_i - z_j||, hence of the cosine, and retrieval by cosine ranks exactly as Hyp's hyperbolic
evaluation does. What is lost is the norm as a free degree (Hyp's head does not L2-normalise).
"""

from __future__ import annotations

import torch
from pytorch_metric_learning.distances import BaseDistance
from pytorch_metric_learning.losses import SupConLoss

HYP_CURVATURE = 0.1  # c
HYP_CLIP_R = 2.3  # feature clipping radius
HYP_TEMPERATURE = 0.2  # tau
BALL_EPS = 1e-3  # points stay within (1 - eps) / sqrt(c) of the origin, as hyptorch's project
ARCOSH_EPS = 1e-6  # arcosh argument >= 1 + eps keeps the gradient finite at d = 0 (self pairs)


def to_poincare(x: torch.Tensor, c: float = HYP_CURVATURE, clip_r: float = HYP_CLIP_R) -> torch.Tensor:
    """Euclidean embeddings (B, E) -> points of the Poincare ball (B, E): clip, expmap0, project."""
    x = x * (clip_r / (x.norm(dim=-1, keepdim=True) + 1e-5)).clamp_max(1.0)  # (B, E), as hyptorch
    norm = x.norm(dim=-1, keepdim=True).clamp_min(1e-5)  # (B, 1)
    sqrt_c = c**0.5
    z = torch.tanh(sqrt_c * norm) * x / (sqrt_c * norm)
    max_norm = (1.0 - BALL_EPS) / sqrt_c
    z_norm = z.norm(dim=-1, keepdim=True).clamp_min(1e-5)
    return torch.where(z_norm > max_norm, z / z_norm * max_norm, z)


def poincare_distance_matrix(z: torch.Tensor, w: torch.Tensor, c: float = HYP_CURVATURE) -> torch.Tensor:
    """Geodesic distances (B, M) between ball points z (B, E) and w (M, E)."""
    zz, ww = (z * z).sum(-1, keepdim=True), (w * w).sum(-1)[None]  # (B, 1), (1, M)
    return _geodesic(zz + ww - 2.0 * z @ w.T, zz, ww, c)  # ||z_i - w_j||^2 (B, M)


def poincare_distance(z: torch.Tensor, w: torch.Tensor, c: float = HYP_CURVATURE) -> torch.Tensor:
    """Geodesic distances (B,) between paired ball points z (B, E) and w (B, E)."""
    return _geodesic(((z - w) ** 2).sum(-1), (z * z).sum(-1), (w * w).sum(-1), c)


def _geodesic(sq: torch.Tensor, zz: torch.Tensor, ww: torch.Tensor, c: float) -> torch.Tensor:
    """arcosh(1 + 2c ||z - w||^2 / ((1 - c ||z||^2)(1 - c ||w||^2))) / sqrt(c), elementwise."""
    arg = 1.0 + 2.0 * c * sq.clamp_min(0.0) / ((1.0 - c * zz) * (1.0 - c * ww))
    return torch.acosh(arg.clamp_min(1.0 + ARCOSH_EPS)) / c**0.5


class PoincareDistance(BaseDistance):
    """pml distance: Euclidean embeddings mapped into the Poincare ball, then geodesic distance."""

    def __init__(self, c: float = HYP_CURVATURE, clip_r: float = HYP_CLIP_R, **kwargs):
        super().__init__(normalize_embeddings=False, is_inverted=False, **kwargs)
        if not (c > 0 and clip_r > 0):
            raise ValueError(f"curvature c={c!r} and clip_r={clip_r!r} must be > 0")
        self.c = float(c)
        self.clip_r = float(clip_r)

    def compute_mat(self, query_emb: torch.Tensor, ref_emb: torch.Tensor) -> torch.Tensor:
        z, w = to_poincare(query_emb, self.c, self.clip_r), to_poincare(ref_emb, self.c, self.clip_r)
        return poincare_distance_matrix(z, w, self.c)

    def pairwise_distance(self, query_emb: torch.Tensor, ref_emb: torch.Tensor) -> torch.Tensor:
        z, w = to_poincare(query_emb, self.c, self.clip_r), to_poincare(ref_emb, self.c, self.clip_r)
        return poincare_distance(z, w, self.c)


def hyp_loss(temperature: float = HYP_TEMPERATURE, c: float = HYP_CURVATURE,
             clip_r: float = HYP_CLIP_R) -> SupConLoss:
    """Hyp's pairwise cross-entropy: SupCon over negative hyperbolic distances / temperature."""
    return SupConLoss(temperature=temperature, distance=PoincareDistance(c=c, clip_r=clip_r))
