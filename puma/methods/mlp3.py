"""MLP-3 Emb. (PUMA Table 2(c)): the frozen backbone and a trained 3-layer MLP head (5.25M at ViT-S)."""

from __future__ import annotations

from puma.config import ModelConfig
from puma.methods.method import Method
from puma.models.backbone import create_backbone
from puma.models.head import MlpEmbeddingHead
from puma.models.puma_model import PumaModel


def build(cfg: ModelConfig) -> PumaModel:
    """Backbone + MLP head (puma.models.head.MlpEmbeddingHead)."""
    backbone = create_backbone(cfg.backbone)
    return PumaModel(backbone, MlpEmbeddingHead(backbone.embed_dim, cfg.head.embed_dim))


MLP3 = Method(name="mlp3", build=build, trainable=("head",))
