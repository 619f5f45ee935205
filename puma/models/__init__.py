"""PUMA model: frozen timm ViT, stochastic adapters, conditional prompt pool, 128-d embedding head."""

from puma.models.adapter import AdaptedBlock, StochasticAdapter, inject_adapters
from puma.models.backbone import BackboneWeightsError, create_backbone, freeze_backbone, load_backbone_weights
from puma.models.head import EmbeddingHead
from puma.models.prompt_pool import PromptPool
from puma.models.puma_model import METHODS, PumaModel, build_model
from puma.models.trainable import (
    count_trainable,
    mark_trainable,
    trainable_parameter_groups,
    trainable_state_dict,
)

__all__ = [
    "METHODS",
    "AdaptedBlock",
    "BackboneWeightsError",
    "EmbeddingHead",
    "PromptPool",
    "PumaModel",
    "StochasticAdapter",
    "build_model",
    "count_trainable",
    "create_backbone",
    "freeze_backbone",
    "inject_adapters",
    "load_backbone_weights",
    "mark_trainable",
    "trainable_parameter_groups",
    "trainable_state_dict",
]
