"""MLP-3 Emb. (PUMA Table 2(c)): the frozen backbone and a trained 3-layer MLP head (5.25M at ViT-S)."""

from __future__ import annotations

from puma.config import Config, ModelConfig
from puma.methods.method import Method, refuse_data_init
from puma.models.backbone import create_backbone
from puma.models.head import MlpEmbeddingHead
from puma.models.puma_model import PumaModel


def build(cfg: ModelConfig) -> PumaModel:
    """Backbone + MLP head (puma.models.head.MlpEmbeddingHead)."""
    backbone = create_backbone(cfg.backbone)
    return PumaModel(backbone, MlpEmbeddingHead(backbone.embed_dim, cfg.head.embed_dim))


def check_config(cfg: Config) -> None:
    """The PCA head init is for the linear head only."""
    refuse_data_init(cfg, head=True, proxies=False)


MLP3 = Method(name="mlp3", build=build, trainable=("head",), check_config=check_config)
