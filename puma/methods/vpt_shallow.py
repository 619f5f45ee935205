"""VPT-Shallow (Jia et al., PUMA Table 2(c)): Np prompt tokens at the input (``model.vpt``), and a head."""

from __future__ import annotations

from puma.config import ModelConfig
from puma.methods.method import Method
from puma.models.backbone import create_backbone
from puma.models.head import EmbeddingHead
from puma.models.vpt import VptModel, build_visual_prompts


def build_vpt(cfg: ModelConfig, deep: bool) -> VptModel:
    """Backbone + VPT prompts (one set, or one per block when ``deep``) + linear head."""
    backbone = create_backbone(cfg.backbone)
    prompts = build_visual_prompts(backbone, cfg.vpt.length, deep)
    return VptModel(backbone, EmbeddingHead(backbone.embed_dim, cfg.head.embed_dim), prompts)


def build(cfg: ModelConfig) -> VptModel:
    """Shallow VPT: one prompt set entering block 0."""
    return build_vpt(cfg, deep=False)


VPT_SHALLOW = Method(name="vpt_shallow", build=build, trainable=("vpt_prompts", "head"))
