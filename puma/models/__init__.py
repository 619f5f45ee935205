"""The model building blocks: frozen timm ViT, stochastic adapters, prompt pool, LoRA, VPT, heads.

Nothing here knows about methods: each method's record (puma/methods/<name>.py) composes these
blocks and declares what trains (``puma.methods.build_model`` builds the model of a config).

The names below load on first use (as in ``puma.losses``): ``python -m puma.models.offline``, which
scripts/setup.sh runs on every set-up, checks its file without importing torch and timm.
"""

from __future__ import annotations


def __getattr__(name: str):  # one branch per module, naming what it exports
    if name in ("AdaptedBlock", "StochasticAdapter", "inject_adapters"):
        from puma.models import adapter as module
    elif name in ("BackboneWeightsError", "create_backbone", "freeze_backbone", "load_backbone_weights"):
        from puma.models import backbone as module
    elif name in ("EmbeddingHead", "MlpEmbeddingHead"):
        from puma.models import head as module
    elif name in ("LoraBranch", "LoraLinear", "inject_lora"):
        from puma.models import lora as module
    elif name == "PromptPool":
        from puma.models import prompt_pool as module
    elif name == "PumaModel":
        from puma.models import puma_model as module
    elif name == "RotationHead":
        from puma.models import rotation as module
    elif name in ("PARTS", "count_trainable", "set_trainable", "trainable_parameter_groups",
                  "trainable_state_dict"):
        from puma.models import trainable as module
    elif name == "UdmlSsModel":
        from puma.models import udml_ss as module
    elif name in ("VisualPrompts", "VptModel"):
        from puma.models import vpt as module
    else:
        raise AttributeError(f"module 'puma.models' has no attribute {name!r}")
    return getattr(module, name)


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
