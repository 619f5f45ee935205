"""LoRA (Hu et al. 2021) on a timm ViT's attention projections, optionally stochastic (PUMA Table 7).

For a frozen projection y = W x + b whose output is split into equal chunks (q | k | v for the fused
``attn.qkv``; one chunk for ``attn.proj``), each targeted chunk t gets a low-rank update:

    y_t = W_t x + b_t + scale * m * (x @ A_t) @ B_t        A_t (D_in, r), B_t (r, D_chunk)

A_t is kaiming-uniform like the adapters' W_down, B_t is zero, so the model starts as the backbone
(the released code initialised B_t kaiming-uniform too, so its LoRA did not start at the pretrained
model: a bug). m = 1 for LoRA; for stochastic LoRA (keep_prob < 1) m is Bernoulli(keep_prob) /
keep_prob drawn per sample and per branch in training, exactly like the stochastic adapters, and 1
at eval. The released code puts LoRA on q and k (the default targets); Hu et al. use q and v. Both
add 2 x (D r + r D) parameters per block: 2.36M at D = 384, r = 128 (paper: LoRA 2.4M with head).

The projection keeps its class's weights and state-dict keys (``LoraLinear`` only adds the ``lora``
branches), so backbone weights load strict into the plain keys.
"""

from __future__ import annotations

import torch
from timm.layers import Attention
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from puma.config import ConfigError, LoraConfig
from puma.models.adapter import LowRankBranch, select_blocks

QKV_CHUNKS = ("q", "k", "v")


class LoraBranch(LowRankBranch):
    """A LoRA branch: x @ A -> @ B -> * scale, A (D_in, r), B (r, D_chunk); the adapter's branch without
    its ReLU, in training kept per sample with probability keep_prob."""

    def __init__(self, in_dim: int, out_dim: int, rank: int, keep_prob: float = 1.0,
                 scale: float = 1.0) -> None:
        super().__init__(in_dim, out_dim, rank, keep_prob, scale)

    def extra_repr(self) -> str:
        (in_dim, rank), out_dim = self.down.shape, self.up.shape[1]
        return f"in={in_dim}, out={out_dim}, rank={rank}, keep_prob={self.keep_prob}, scale={self.scale}"


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` plus LoRA branches on named chunks of its output (others pass unchanged)."""

    lora: nn.ModuleDict
    chunks: tuple[str, ...]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)  # (B, N, out_features)
        parts = out.chunk(len(self.chunks), dim=-1)  # each (B, N, out_features / len(chunks))
        return torch.cat([p + self.lora[c](x) if c in self.lora else p
                          for c, p in zip(self.chunks, parts, strict=True)], dim=-1)


def add_lora(linear: nn.Linear, chunks: tuple[str, ...], targets: list[str], cfg: LoraConfig) -> None:
    """Turn ``linear`` into a LoraLinear with a branch for each chunk in ``targets``."""
    if linear.out_features % len(chunks):
        raise ConfigError(f"cannot split a projection of {linear.out_features} outputs into {chunks}")
    out_dim = linear.out_features // len(chunks)
    device = linear.weight.device
    branches = {t: LoraBranch(linear.in_features, out_dim, cfg.rank, cfg.keep_prob, cfg.scale).to(device)
                for t in chunks if t in targets}
    linear.__class__ = LoraLinear
    linear.chunks = chunks
    linear.lora = nn.ModuleDict(branches)


def inject_lora(vit: VisionTransformer, cfg: LoraConfig) -> list[int]:
    """Add LoRA branches on ``cfg.targets`` to each block in ``cfg.blocks`` (None: all); returns indices."""
    indices = select_blocks(len(vit.blocks), cfg.blocks, "model.lora.blocks")
    for i in indices:
        attn = vit.blocks[i].attn
        if type(attn) is not Attention or type(attn.qkv) is not nn.Linear:
            raise ConfigError(f"block {i} has a {type(attn).__name__} attention; LoRA is injected into "
                              "timm's layers.Attention with a fused nn.Linear qkv only")
        qkv_targets = [t for t in cfg.targets if t in QKV_CHUNKS]
        if qkv_targets:
            add_lora(attn.qkv, QKV_CHUNKS, qkv_targets, cfg)
        if "proj" in cfg.targets:
            add_lora(attn.proj, ("proj",), ["proj"], cfg)
    return indices
