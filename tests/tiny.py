"""Tiny model configs and inputs for fast CPU tests (import as ``from tiny import ...``).

pytest puts ``tests/`` on ``sys.path`` for test modules, so other test files can share these.
The tiny backbone is timm's ViT-Ti/16 shrunk to 32 px, patch 8 (4x4 grid), width 48, 2 blocks.
``make_checkpoint`` saves a real tiny checkpoint; ``reference_embeddings`` is its in-process forward.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from puma.checkpoint import CheckpointState, load_model, probe_embeddings, save_checkpoint
from puma.config import Config, ModelConfig, from_dict, to_dict
from puma.data.images import ViewSpec, backbone_normalisation, make_view
from puma.methods import build_model
from puma.models.trainable import trainable_state_dict

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


def make_checkpoint(uri: str, seed: int = 0, **sections: Any) -> str:
    """A tiny PUMA checkpoint with perturbed (non-initial) trainable weights and its probe
    (``sections`` as in :func:`tiny_model_config`, e.g. ``method="lora"``)."""
    cfg = tiny_config(**sections)
    torch.manual_seed(0)  # the same random backbone for every seed
    model = build_model(cfg.model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    meta = {"probe": probe_embeddings(model, cfg.model.backbone.img_size), "backbone_weights": "none"}
    return save_checkpoint(uri, CheckpointState(config=cfg, model=trainable_state_dict(model), meta=meta))



def reference_embeddings(checkpoint: str, table: pa.Table) -> np.ndarray:
    """The in-process model forward of each row's image bytes (eval view), no Ray: (N, E)."""
    import pyarrow.parquet as pq

    model, cfg = load_model(checkpoint)
    mean, std = backbone_normalisation(cfg)
    spec = ViewSpec(img_size=cfg.model.backbone.img_size, mean=mean, std=std, train=False)
    views = []
    for uri, row in zip(table["image_uri"].to_pylist(), table["image_row"].to_pylist(), strict=True):
        data = Path(uri).read_bytes() if row < 0 else \
            pq.read_table(uri, columns=["image"])["image"][row].as_py()
        views.append(make_view(data, spec))
    with torch.no_grad():
        return model(torch.from_numpy(np.stack(views))).numpy()


def train_module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of a train module's trainable model tensors ("model.*") and loss state ("loss.*")."""
    from puma.models.trainable import trainable_state_dict

    out = {f"model.{k}": v.detach().clone() for k, v in trainable_state_dict(module.model).items()}
    out.update({f"loss.{k}": v.detach().clone() for k, v in module.loss.state_dict().items()})
    return out
