"""Stochastic adapters (paper Eq. 4-5), two per selected block, injected into a timm ViT; their
low-rank branch (``LowRankBranch``) is LoRA's too.

In a block with adapters (each adapter fed the same LayerNorm output as its sub-block):

    h = norm1(x);  x = x + drop_path1(ls1(attn(h))) + adapter_attn(h)
    h = norm2(x);  x = x + drop_path2(ls2(mlp(h)))  + adapter_mlp(h)

As in the released code, the adapter output bypasses the block's LayerScale and DropPath; its own
stochasticity is the per-sample keep mask. With ``model.adapter.layer_scale`` the adapter output is
multiplied by its sub-block's LayerScale (``ls1`` / ``ls2``), so an adapter's update is measured
against its sub-block's own: the same thing on ViTs without LayerScale (the paper's ViT-S/16), but
on DINOv2 (LayerScale 0.1-0.3 in the first blocks, 2-7 in the last) it keeps the early adapters
from dominating their blocks (``bench/recipe_lab.py`` shows it; see docs/recipe.md).

The block keeps its class's weights and state-dict keys (``AdaptedBlock`` only adds the two adapter
submodules and a forward), so pretrained weights still load strict into the plain keys.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from puma.config import AdapterConfig, ConfigError


def sample_keep_mask(x: torch.Tensor, keep_prob: float) -> torch.Tensor:
    """Per-sample Bernoulli(keep_prob) / keep_prob, shape (B, 1, ..., 1): gamma of Eq. 5, inverted dropout."""
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    return x.new_empty(shape).bernoulli_(keep_prob).div_(keep_prob)


class LowRankBranch(nn.Module):
    """x @ down -> activation -> @ up -> * scale; in training kept per sample with probability keep_prob.

    The one implementation of the stochastic adapter (ReLU, Eq. 4-5) and of the (stochastic) LoRA
    branch (no activation, puma/models/lora.py). Training multiplies the output by Bernoulli(keep_prob)
    / keep_prob drawn per sample (B, 1, 1) (inverted dropout, timm DropPath with drop = 1 - keep_prob);
    eval always adds it, unscaled. ``keep_prob = 1`` is the static branch.
    """

    def __init__(self, in_dim: int, out_dim: int, rank: int, keep_prob: float, scale: float,
                 activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        if not 0.0 < keep_prob <= 1.0:
            raise ValueError(f"keep_prob={keep_prob!r} is out of range; valid: 0 < keep_prob <= 1")
        self.keep_prob = keep_prob
        self.scale = scale
        self.activation = activation
        self.down = nn.Parameter(torch.empty(in_dim, rank))  # W_down / A (D_in, r)
        self.up = nn.Parameter(torch.zeros(rank, out_dim))  # W_up / B (r, D_out), zero: starts as a no-op
        # the released code's he_uniform (a=1) on the (D_in, r) tensor: U(-sqrt(3 / r), sqrt(3 / r))
        nn.init.kaiming_uniform_(self.down, a=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.down  # (B, N, D_in) -> (B, N, r)
        if self.activation is not None:
            h = self.activation(h)
        out = h @ self.up * self.scale  # (B, N, r) -> (B, N, D_out)
        if self.training and self.keep_prob < 1.0:
            out = out * sample_keep_mask(x, self.keep_prob)
        return out


class StochasticAdapter(LowRankBranch):
    """The stochastic adapter: x @ W_down -> ReLU -> @ W_up -> * scale, W_down (D, r), W_up (r, D)."""

    def __init__(self, dim: int, rank: int, keep_prob: float, scale: float = 0.1) -> None:
        super().__init__(dim, dim, rank, keep_prob, scale, activation=torch.relu)

    def extra_repr(self) -> str:
        dim, rank = self.down.shape
        return f"dim={dim}, rank={rank}, keep_prob={self.keep_prob}, scale={self.scale}"


class AdaptedBlock(Block):
    """A timm ``Block`` with an adapter beside its attention and one beside its MLP."""

    adapter_attn: StochasticAdapter
    adapter_mlp: StochasticAdapter
    adapter_layer_scale: bool = False  # adapter outputs through ls1 / ls2 (model.adapter.layer_scale)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        h = self.norm1(x)  # (B, N, D)
        x = x + self.drop_path1(self.ls1(self.attn(h, attn_mask=attn_mask, is_causal=is_causal)))
        x = x + self._scaled(self.ls1, self.adapter_attn(h))
        h = self.norm2(x)
        x = x + self.drop_path2(self.ls2(self.mlp(h))) + self._scaled(self.ls2, self.adapter_mlp(h))
        return x

    def _scaled(self, layer_scale: nn.Module, update: torch.Tensor) -> torch.Tensor:
        return layer_scale(update) if self.adapter_layer_scale else update


def inject_adapters(vit: VisionTransformer, cfg: AdapterConfig) -> list[int]:
    """Add two stochastic adapters to each block in ``cfg.blocks`` (None: all); returns the indices."""
    indices = select_blocks(len(vit.blocks), cfg.blocks)
    for i in indices:
        block = vit.blocks[i]
        if type(block) is not Block:
            raise ConfigError(f"block {i} of the backbone is a {type(block).__name__}; adapters are "
                              "injected into timm's pre-norm vision_transformer.Block only")
        dim, device = vit.embed_dim, next(block.parameters()).device
        block.adapter_attn = StochasticAdapter(dim, cfg.rank, cfg.keep_prob, cfg.scale).to(device)
        block.adapter_mlp = StochasticAdapter(dim, cfg.rank, cfg.keep_prob, cfg.scale).to(device)
        block.__class__ = AdaptedBlock
        block.adapter_layer_scale = cfg.layer_scale
    return indices


def select_blocks(depth: int, blocks: Optional[list[int]], key: str = "model.adapter.blocks") -> list[int]:
    """Validated, sorted block indices (``None``: every block of a ``depth``-block ViT); ``key`` names
    the config key in errors."""
    if blocks is None:
        return list(range(depth))
    bad = sorted({b for b in blocks if not 0 <= b < depth})
    if bad:
        raise ConfigError(f"{key} has index(es) {bad} out of range for a backbone with "
                          f"{depth} blocks; valid: 0..{depth - 1}")
    return sorted(set(blocks))
