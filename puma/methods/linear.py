"""Linear Emb. (PUMA Table 2(c)): the frozen backbone and a trained linear head."""

from __future__ import annotations

from puma.config import ModelConfig
from puma.methods.method import Method
from puma.models.backbone import create_backbone
from puma.models.head import EmbeddingHead
from puma.models.puma_model import PumaModel


def build(cfg: ModelConfig) -> PumaModel:
    """Backbone + linear head, nothing added (linear, bitfit and full_finetune differ in what trains)."""
    backbone = create_backbone(cfg.backbone)
    return PumaModel(backbone, EmbeddingHead(backbone.embed_dim, cfg.head.embed_dim))


LINEAR = Method(name="linear", build=build, trainable=("head",))
