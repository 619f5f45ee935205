"""UDML-SS (Cao, Chen, Lim): unsupervised metric learning on k-means pseudo-labels plus rotation loss.

Adapted to the frozen-ViT setting: the paper fine-tunes the whole backbone f_theta1; here what adapts
f_theta1 is PUMA's (stochastic adapters and prompt pool, as ``model.adapter.enabled`` and
``model.prompt_pool.enabled`` say), shared by both tasks, so the rotation loss shapes the features
the embedding head g_theta2 sees. On top of the final-norm CLS token sit two heads, as in the paper:
the embedding head (Linear -> L2) and the rotation head h_theta3 (Linear(D -> 4)). What trains is
declared in the method's record, puma/methods/udml_ss.py, with the loss and the pseudo-labels.
"""

from __future__ import annotations

from typing import Optional

import torch
from timm.models.vision_transformer import VisionTransformer

from puma.models.head import EmbeddingHead
from puma.models.prompt_pool import PromptPool
from puma.models.puma_model import PumaModel
from puma.models.rotation import RotationHead


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
