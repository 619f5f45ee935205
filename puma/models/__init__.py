"""PUMA model: frozen timm ViT, stochastic adapters, conditional prompt pool, 128-d embedding head."""

from puma.models.adapter import AdaptedBlock, StochasticAdapter, inject_adapters
from puma.models.backbone import BackboneWeightsError, create_backbone, freeze_backbone, load_backbone_weights
from puma.models.baselines import MlpEmbeddingHead, register_baselines
from puma.models.head import EmbeddingHead
from puma.models.lora import LoraBranch, LoraLinear, inject_lora
from puma.models.prompt_pool import PromptPool
from puma.models.puma_model import METHODS, PumaModel, build_model
from puma.models.rotation import RotationHead
from puma.models.trainable import (
    METHOD_TRAINABLE,
    count_trainable,
    mark_trainable,
    trainable_parameter_groups,
    trainable_state_dict,
)
from puma.models.udml_ss import UdmlSsModel, register_udml_ss
from puma.models.vpt import VisualPrompts, VptModel

register_baselines()
register_udml_ss()

__all__ = [
    "METHODS",
    "METHOD_TRAINABLE",
    "AdaptedBlock",
    "BackboneWeightsError",
    "EmbeddingHead",
    "LoraBranch",
    "LoraLinear",
    "MlpEmbeddingHead",
    "PromptPool",
    "PumaModel",
    "RotationHead",
    "StochasticAdapter",
    "UdmlSsModel",
    "VisualPrompts",
    "VptModel",
    "build_model",
    "count_trainable",
    "create_backbone",
    "freeze_backbone",
    "inject_adapters",
    "inject_lora",
    "load_backbone_weights",
    "mark_trainable",
    "trainable_parameter_groups",
    "trainable_state_dict",
]
