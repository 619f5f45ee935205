"""PUMA + LoRA (PUMA Table 7): PUMA's adapters and prompt pool, plus LoRA on the attention projections."""

from __future__ import annotations

from puma.config import ModelConfig
from puma.methods import puma
from puma.methods.method import Method
from puma.models.lora import inject_lora
from puma.models.puma_model import PumaModel


def build(cfg: ModelConfig) -> PumaModel:
    """PUMA's model with LoRA branches injected."""
    model = puma.build(cfg)
    inject_lora(model.backbone, cfg.lora)
    return model


PUMA_LORA = Method(name="puma_lora", build=build, trainable=("adapters", "prompt_pool", "lora", "head"))
