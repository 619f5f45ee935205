"""AdaptFormer (PUMA Table 2(c)): PUMA's adapters, static (keep_prob = 1), no prompt pool, and a head.

Reads ``model.adapter`` rank, scale and blocks; static by definition, it ignores ``keep_prob``.
"""

from __future__ import annotations

import dataclasses

from puma.config import ModelConfig
from puma.methods import linear
from puma.methods.method import Method
from puma.models.adapter import inject_adapters
from puma.models.puma_model import PumaModel


def build(cfg: ModelConfig) -> PumaModel:
    """The linear method's model with static adapters in the selected blocks."""
    model = linear.build(cfg)
    inject_adapters(model.backbone, dataclasses.replace(cfg.adapter, keep_prob=1.0))
    return model


ADAPTFORMER = Method(name="adaptformer", build=build, trainable=("adapters", "head"))
