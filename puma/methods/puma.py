"""PUMA (the paper): stochastic adapters (Eq. 4-5) + conditional prompt pool (Eq. 6-10) + head.

Adapters and the prompt pool are built as ``model.adapter.enabled`` / ``model.prompt_pool.enabled``
say (the ablations of Table 3); the loss is ``loss.name`` (CurricularFace by default).
"""

from __future__ import annotations

from puma.config import ModelConfig
from puma.methods.method import Method
from puma.models.adapter import inject_adapters
from puma.models.backbone import create_backbone
from puma.models.head import EmbeddingHead
from puma.models.prompt_pool import PromptPool
from puma.models.puma_model import PumaModel


def build(cfg: ModelConfig) -> PumaModel:
    """Backbone with adapters and prompt pool as enabled in the config, 128-d head."""
    backbone = create_backbone(cfg.backbone)
    if cfg.adapter.enabled:
        inject_adapters(backbone, cfg.adapter)
    pool = None
    if cfg.prompt_pool.enabled:
        pool = PromptPool(backbone.embed_dim, cfg.prompt_pool.pool_size, cfg.prompt_pool.length,
                          centred=cfg.prompt_pool.init == "data")
    head = EmbeddingHead(backbone.embed_dim, cfg.head.embed_dim)
    return PumaModel(backbone, head, pool, ortho_weight=cfg.prompt_pool.ortho_weight)


PUMA = Method(name="puma", build=build, trainable=("adapters", "prompt_pool", "head"))
