"""VPT-Deep (Jia et al., PUMA Table 2(c)): fresh Np prompt tokens before every block (``model.vpt``)."""

from __future__ import annotations

from puma.config import ModelConfig
from puma.methods.method import Method
from puma.methods.vpt_shallow import build_vpt
from puma.models.vpt import VptModel


def build(cfg: ModelConfig) -> VptModel:
    """Deep VPT: one prompt set per block."""
    return build_vpt(cfg, deep=True)


VPT_DEEP = Method(name="vpt_deep", build=build, trainable=("vpt_prompts", "head"))
