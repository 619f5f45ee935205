"""Visual prompt tuning (Jia et al., ECCV 2022) on the frozen ViT: the VPT baseline of PUMA Table 2(c).

Np learned prompt tokens, the same for every image, sit right after CLS (where PUMA puts its
conditional prompt, and with the CLS position embedding, as the released code does):

    shallow   [CLS, P_0, (reg tokens), patches] enters block 0; the prompt outputs flow on
    deep      before block i > 0 the Np prompt outputs are replaced by fresh tokens P_i
              (one (Np, D) set per block: depth x Np x D parameters; 86K + head at ViT-S, Np = 8)

Prompts are initialised U(-v, v), v = sqrt(6 / (3 * patch_h * patch_w + D)) (VPT's xavier-style
init over the patch embedding's fan-in; the released code used 196 patches in place of the patch
area). Only CLS is read out, so the prompt outputs of the last block are dropped.
"""

from __future__ import annotations

import math

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from puma.models.head import EmbeddingHead
from puma.models.puma_model import PumaModel


class VisualPrompts(nn.Module):
    """VPT prompt tokens (L, Np, D): L = 1 (shallow) or the backbone depth (deep)."""

    def __init__(self, num_layers: int, length: int, dim: int, patch_fan_in: int) -> None:
        super().__init__()
        self.prompts = nn.Parameter(torch.empty(num_layers, length, dim))  # (L, Np, D)
        bound = math.sqrt(6.0 / float(patch_fan_in + dim))
        nn.init.uniform_(self.prompts, -bound, bound)

    @property
    def length(self) -> int:
        return self.prompts.shape[1]

    @property
    def deep(self) -> bool:
        return self.prompts.shape[0] > 1

    def extra_repr(self) -> str:
        layers, length, dim = self.prompts.shape
        return f"layers={layers}, length={length}, dim={dim}"


class VptModel(PumaModel):
    """Frozen ViT + VPT prompts (shallow or deep) + embedding head; no adapters, no prompt pool."""

    def __init__(self, backbone: VisionTransformer, head: EmbeddingHead,
                 visual_prompts: VisualPrompts) -> None:
        super().__init__(backbone, head)
        depth = len(backbone.blocks)
        if visual_prompts.deep and visual_prompts.prompts.shape[0] != depth:
            raise ValueError(f"deep VPT needs one prompt set per block ({depth}); "
                             f"got {visual_prompts.prompts.shape[0]}")
        self.visual_prompts = visual_prompts

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """Final-norm CLS token (B, D) with VPT prompts in the token sequence."""
        vit, prompts = self.backbone, self.visual_prompts.prompts  # prompts (L, Np, D)
        x = vit.patch_drop(vit._pos_embed(vit.patch_embed(images)))  # (B, prefix + N, D)
        x = vit.norm_pre(self._insert_prompts(x, prompts[0].expand(x.shape[0], -1, -1)))
        for i, block in enumerate(vit.blocks):
            if 0 < i < prompts.shape[0]:
                x = replace_prompts(x, prompts[i])  # deep: fresh tokens before every later block
            x = block(x)
        return vit.fc_norm(vit.norm(x)[:, 0])  # (B, D)


def replace_prompts(x: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """[CLS, old prompts (Np), rest] (B, 1 + Np + L, D) -> [CLS, prompt (Np, D), rest]."""
    n_p = prompt.shape[0]
    fresh = prompt.to(x.dtype).expand(x.shape[0], -1, -1)  # (B, Np, D)
    return torch.cat([x[:, :1], fresh, x[:, 1 + n_p:]], dim=1)


def build_visual_prompts(vit: VisionTransformer, length: int, deep: bool) -> VisualPrompts:
    """VPT prompts sized for ``vit``: one set (shallow) or one per block (deep)."""
    proj = vit.patch_embed.proj  # Conv2d(in_chans, D, patch, patch)
    fan_in = proj.in_channels * proj.kernel_size[0] * proj.kernel_size[1]
    layers = len(vit.blocks) if deep else 1
    return VisualPrompts(layers, length, vit.embed_dim, fan_in).to(proj.weight.device)
