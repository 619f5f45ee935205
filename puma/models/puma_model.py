"""PumaModel: frozen timm ViT + stochastic adapters + conditional prompt pool + embedding head.

Every method's model is a PumaModel (or a subclass); which pieces it holds is decided by the
method's record (puma/methods/<name>.py). The forward pass is paper Eq. 2 / 10 with Eq. 3 / 5 in
the blocks; the prompt pool is Eq. 6-9 (puma/models/prompt_pool.py).

Token sequence entering the blocks (prompts inserted right after CLS, before register tokens):

    [CLS, P_1 .. P_Np, (reg tokens), patches]

Each prompt token gets the CLS position embedding (none when the ViT adds no position embedding to
its CLS token, ``no_embed_class``). The prompt-pool query is (mean + max over patch tokens) / 2 of
the patch embeddings, taken before the CLS token and position embedding, and detached.
"""

from __future__ import annotations

from typing import Optional

import torch
from timm.data import resolve_data_config
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from puma.config import ConfigError
from puma.models.backbone import set_norms_eval
from puma.models.head import EmbeddingHead
from puma.models.prompt_pool import PromptPool


class PumaModel(nn.Module):
    """images (B, 3, H, W) -> L2-normalised embeddings (B, embed_dim)."""

    method: str = "puma"  # the model.method it was built for (puma.methods.build_model sets it)

    def __init__(self, backbone: VisionTransformer, head: EmbeddingHead,
                 prompt_pool: Optional[PromptPool] = None, ortho_weight: float = 0.0) -> None:
        super().__init__()
        if backbone.cls_token is None:
            name = backbone.pretrained_cfg.get("architecture")
            raise ConfigError(f"PUMA embeds the CLS token, but backbone {name!r} has none "
                              "(class_token=False); choose a ViT with a class token")
        self.backbone = backbone
        self.prompt_pool = prompt_pool
        self.head = head
        self.ortho_weight = ortho_weight

    @property
    def num_features(self) -> int:
        """D, the backbone width."""
        return self.backbone.embed_dim

    @property
    def embed_dim(self) -> int:
        """E, the embedding size."""
        return self.head.proj.out_features

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(images))  # (B, D) -> (B, E)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """Final-norm CLS token (B, D)."""
        vit = self.backbone
        x = vit.patch_embed(images)  # (B, N, D), or (B, H', W', D) with dynamic_img_size
        query = patch_query(x)  # (B, D)
        x = vit.patch_drop(vit._pos_embed(x))  # (B, prefix + N, D)
        if self.prompt_pool is not None:
            x = self._insert_prompts(x, self.prompt_pool(query))  # (B, prefix + Np + N, D)
        x = vit.blocks(vit.norm_pre(x))
        return vit.fc_norm(vit.norm(x)[:, 0])  # (B, D)

    def _insert_prompts(self, x: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
        """[CLS, rest] (B, 1 + L, D) + prompt (B, Np, D) -> [CLS, prompt + pos_CLS, rest]."""
        vit = self.backbone
        if vit.pos_embed is not None and not vit.no_embed_class:
            prompt = prompt + vit.pos_embed[:, :1]  # CLS position embedding (1, 1, D)
        return torch.cat([x[:, :1], prompt.to(x.dtype), x[:, 1:]], dim=1)

    def aux_loss(self) -> torch.Tensor:
        """ortho_weight * prompt-pool orthogonality penalty (a 0 tensor without a pool)."""
        if self.prompt_pool is None or self.ortho_weight == 0:
            return self.head.proj.weight.new_zeros(())
        return self.ortho_weight * self.prompt_pool.ortho_loss()

    def train(self, mode: bool = True) -> PumaModel:
        """Train/eval as usual, but the frozen backbone's normalisation layers stay in eval mode."""
        super().train(mode)
        set_norms_eval(self.backbone)
        return self

    def data_config(self) -> dict:
        """timm data config of the backbone (mean, std, interpolation, crop_pct, input_size)."""
        cfg = resolve_data_config({}, model=self.backbone)
        cfg["input_size"] = (3, *self.backbone.patch_embed.img_size)
        return cfg


def patch_query(patches: torch.Tensor) -> torch.Tensor:
    """Prompt-pool query (B, D) = (mean + max over patch tokens) / 2, detached."""
    tokens = patches.flatten(1, -2)  # (B, N, D)
    return ((tokens.mean(dim=1) + tokens.amax(dim=1)) / 2).detach()
