"""Conditional prompt pool (paper Eq. 7-9; the query q of Eq. 6 is puma_model.patch_query).

M prompts P_m (Np, D), keys K_m (D) and feature-attention vectors A_m (D) (Eq. 7). For a query q (D):

    alpha_m = cos(q * softmax(A_m), K_m)        Eq. 8; raw cosine: no softmax over m, no normalisation
    prompt  = sum_m alpha_m P_m                 Eq. 9; (Np, D)

(The released code also passes alpha through a BatchNorm1d(affine=False) kept in eval mode with its
initial statistics, i.e. a division by sqrt(1 + 1e-5); it is left out.) The orthogonality penalty is
the released code's mean((T T^T - I)^2) summed over T = K, A and P flattened to (M, Np * D).

Centred queries (``centred=True``, model.prompt_pool.init=data; not in the paper): alpha_m =
cos((q - c) * softmax(A_m), K_m) with a learned centre c (D). The patch queries of different images
are nearly parallel (cosine 0.75-0.93 on the demo data), so against random keys alpha is 0.01 +- 0.02
for every image and the pool hands every image nearly the same prompt; :meth:`init_from_queries` sets
c to the queries' mean and the keys to their top principal directions, so alpha varies across images
from the first step (std over images 0.13 against 0.02 on the demo data). It did not score better
at the demo's budget, with Np = 8 or Np = 1 (docs/recipe.md); random stays the default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from puma.models.head import principal_directions


class PromptPool(nn.Module):
    """M prompts of Np tokens mixed by cosine weights of an attended query against learned keys."""

    def __init__(self, dim: int, pool_size: int, length: int, centred: bool = False) -> None:
        super().__init__()
        self.prompts = nn.Parameter(torch.empty(pool_size, length, dim))  # P (M, Np, D)
        self.keys = nn.Parameter(torch.empty(pool_size, dim))  # K (M, D)
        self.attention = nn.Parameter(torch.empty(pool_size, dim))  # A (M, D)
        self.centre = nn.Parameter(torch.zeros(dim)) if centred else None  # c (D), centred queries only
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Orthogonal init as the released code, but each prompt P_m drawn independently."""
        nn.init.orthogonal_(self.keys)
        nn.init.orthogonal_(self.attention)
        if self.centre is not None:
            nn.init.zeros_(self.centre)
        with torch.no_grad():
            for prompt in self.prompts:  # (Np, D) each; the released code copied P_0 into every P_m
                nn.init.orthogonal_(prompt)

    @property
    def pool_size(self) -> int:
        return self.prompts.shape[0]

    @property
    def length(self) -> int:
        return self.prompts.shape[1]

    def weights(self, query: torch.Tensor) -> torch.Tensor:
        """alpha (B, M) = cos(q * softmax(A_m), K_m) for query (B, D); q - c with a centre."""
        if self.centre is not None:
            query = query - self.centre
        attended = query[:, None, :] * self.attention.softmax(dim=-1)[None]  # (B, M, D)
        return F.cosine_similarity(attended, self.keys[None], dim=-1)  # (B, M)

    def forward(self, query: torch.Tensor) -> torch.Tensor:
        """Prompt (B, Np, D) = sum_m alpha_m P_m."""
        return torch.einsum("bm,mld->bld", self.weights(query), self.prompts)

    @torch.no_grad()
    def init_from_queries(self, mean: torch.Tensor, cov: torch.Tensor) -> None:
        """Centre c = the queries' mean (D,); keys = the top-M principal directions of cov (D, D)."""
        dim = self.keys.shape[1]
        if self.centre is None:
            raise ValueError("init_from_queries needs a pool built with centred=True "
                             "(model.prompt_pool.init=data)")
        if mean.shape != (dim,) or cov.shape != (dim, dim):
            raise ValueError(f"query statistics must be mean ({dim},) and covariance ({dim}, {dim}); "
                             f"got {tuple(mean.shape)} and {tuple(cov.shape)}")
        top = min(self.pool_size, dim)  # a pool larger than D keeps its random keys beyond the D-th
        self.centre.copy_(mean.to(self.centre))
        self.keys[:top].copy_(principal_directions(cov, top).to(self.keys))

    def ortho_loss(self) -> torch.Tensor:
        """Unweighted orthogonality penalty on K, A and P (scalar)."""
        return sum(_ortho_penalty(t) for t in (self.keys, self.attention, self.prompts.flatten(1)))

    def extra_repr(self) -> str:
        centred = ", centred=True" if self.centre is not None else ""
        return f"dim={self.prompts.shape[2]}, pool_size={self.pool_size}, length={self.length}{centred}"


def _ortho_penalty(t: torch.Tensor) -> torch.Tensor:
    """mean((T T^T - I)^2) for T (M, K)."""
    eye = torch.eye(t.shape[0], device=t.device, dtype=t.dtype)
    return ((t @ t.T - eye) ** 2).mean()
