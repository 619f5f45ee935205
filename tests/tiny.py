"""Tiny model configs and inputs for fast CPU tests (import as ``from tiny import ...``).

pytest puts ``tests/`` on ``sys.path`` for test modules, so other test files can share these.
The tiny backbone is timm's ViT-Ti/16 shrunk to 32 px, patch 8 (4x4 grid), width 48, 2 blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from puma.config import Config, ModelConfig, from_dict, to_dict

TINY_BACKBONE = {
    "name": "vit_tiny_patch16_224",
    "weights": "none",
    "img_size": 32,
    "model_kwargs": {"patch_size": 8, "embed_dim": 48, "depth": 2, "num_heads": 3},
}
TINY_MODEL = {
    "method": "puma",
    "backbone": TINY_BACKBONE,
    "adapter": {"enabled": True, "rank": 8, "keep_prob": 0.5},
    "prompt_pool": {"enabled": True, "pool_size": 4, "length": 2},
    "head": {"embed_dim": 16},
}


def tiny_model_config(**sections: Any) -> ModelConfig:
    """Tiny ModelConfig; each keyword overrides a field or merges into a section.

    e.g. ``tiny_model_config(adapter={"keep_prob": 1.0}, prompt_pool={"enabled": False})``.
    """
    data = to_dict(from_dict(TINY_MODEL, ModelConfig))
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return from_dict(data, ModelConfig)


def tiny_config(**sections: Any) -> Config:
    """A default Config whose model is tiny (``sections`` as in :func:`tiny_model_config`)."""
    return dataclasses.replace(Config(), model=tiny_model_config(**sections))


def tiny_images(batch: int = 4, size: int = 32, seed: int = 0) -> torch.Tensor:
    """Random normalised-looking images (B, 3, size, size)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=gen)


def assert_eval_deterministic_train_stochastic(model: torch.nn.Module, x: torch.Tensor) -> None:
    """Two eval forwards are equal; two training forwards (fresh Bernoulli keep masks) differ."""
    with torch.no_grad():
        model.eval()
        assert torch.equal(model(x), model(x))
        model.train()
        assert not torch.equal(model(x), model(x))
