"""The model building blocks: frozen timm ViT, stochastic adapters, prompt pool, LoRA, VPT, heads.

Nothing here knows about methods: each method's record (puma/methods/<name>.py) composes these
blocks and declares what trains (``puma.methods.build_model`` builds the model of a config).
"""

from puma.models.adapter import AdaptedBlock, StochasticAdapter, inject_adapters
from puma.models.backbone import BackboneWeightsError, create_backbone, freeze_backbone, load_backbone_weights
from puma.models.head import EmbeddingHead, MlpEmbeddingHead
from puma.models.lora import LoraBranch, LoraLinear, inject_lora
from puma.models.prompt_pool import PromptPool
from puma.models.puma_model import PumaModel
from puma.models.rotation import RotationHead
from puma.models.trainable import (
    PARTS,
    count_trainable,
    set_trainable,
    trainable_parameter_groups,
    trainable_state_dict,
)
from puma.models.udml_ss import UdmlSsModel
from puma.models.vpt import VisualPrompts, VptModel

__all__ = [
    "PARTS",
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
    "count_trainable",
    "create_backbone",
    "freeze_backbone",
    "inject_adapters",
    "inject_lora",
    "load_backbone_weights",
    "set_trainable",
    "trainable_parameter_groups",
    "trainable_state_dict",
]
