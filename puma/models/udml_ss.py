"""UDML-SS (Cao, Chen, Lim): unsupervised metric learning on k-means pseudo-labels plus rotation loss.

Adapted to the frozen-ViT setting: the paper fine-tunes the whole backbone f_theta1; here what adapts
f_theta1 is PUMA's (stochastic adapters and prompt pool, as ``model.adapter.enabled`` and
``model.prompt_pool.enabled`` say), shared by both tasks, so the rotation loss shapes the features
the embedding head g_theta2 sees. On top of the final-norm CLS token sit two heads, as in the paper:
the embedding head (Linear -> L2) and the rotation head h_theta3 (Linear(D -> 4)). What trains is
declared in puma.models.trainable; the pseudo-labels and the loss live in puma.train.udml_ss.
"""

from __future__ import annotations

from typing import Optional

import torch
from timm.models.vision_transformer import VisionTransformer

from puma.config import ModelConfig
from puma.models.head import EmbeddingHead
from puma.models.prompt_pool import PromptPool
from puma.models.puma_model import METHODS, PumaModel, _build_puma
from puma.models.rotation import RotationHead

METHOD = "udml_ss"


class UdmlSsModel(PumaModel):
    """PumaModel (images -> embeddings) with a rotation-prediction head on the same features."""

    def __init__(self, backbone: VisionTransformer, head: EmbeddingHead, prompt_pool: Optional[PromptPool],
                 ortho_weight: float = 0.0) -> None:
        super().__init__(backbone, head, prompt_pool, ortho_weight)
        self.rotation_head = RotationHead(backbone.embed_dim)

    def embed_and_rotation_logits(self, images: torch.Tensor, rotated: torch.Tensor
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over [images; rotated] (2B, 3, S, S): embeddings of ``images`` (B, E) only, and
        rotation logits of ``rotated`` (B, 4) only; the rotated images never reach the embedding head."""
        features = self.forward_features(torch.cat([images, rotated]))  # (2B, D)
        b = images.shape[0]
        return self.head(features[:b]), self.rotation_head(features[b:])

    def rotation_logits(self, images: torch.Tensor) -> torch.Tensor:
        """Rotation logits (B, 4) of (already rotated) images."""
        return self.rotation_head(self.forward_features(images))


def _build_udml_ss(cfg: ModelConfig) -> UdmlSsModel:
    """PUMA's backbone adaptation and embedding head, plus the rotation head."""
    puma = _build_puma(cfg)
    return UdmlSsModel(puma.backbone, puma.head, puma.prompt_pool, ortho_weight=puma.ortho_weight)


def register_udml_ss() -> None:
    """Add udml_ss to the METHODS registry (idempotent; done when puma.models is imported)."""
    METHODS[METHOD] = _build_udml_ss
