"""LoRA (Hu et al., PUMA Table 2(c)) on the attention projections (``model.lora``), and a head.

``model.lora.keep_prob < 1`` is stochastic LoRA (PUMA Table 7).
"""

from __future__ import annotations

from puma.config import ModelConfig
from puma.methods import linear
from puma.methods.method import Method
from puma.models.lora import inject_lora
from puma.models.puma_model import PumaModel


def build(cfg: ModelConfig) -> PumaModel:
    """The linear method's model with LoRA branches injected."""
    model = linear.build(cfg)
    inject_lora(model.backbone, cfg.lora)
    return model


LORA = Method(name="lora", build=build, trainable=("lora", "head"))
