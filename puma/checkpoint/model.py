"""The model a checkpoint rebuilds, the probe embeddings that fingerprint it, and its model id.

A checkpoint stores the eval-mode embeddings of a fixed seeded batch (:func:`probe_images`); a reloaded
model must reproduce them (:func:`verify_probe`), so a different frozen backbone or an edited weight file
is refused in one line. :func:`checkpoint_id` is what an index records as its model.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from puma import storage
from puma.checkpoint.files import (
    CONFIG_FILE,
    MODEL_FILE,
    CheckpointError,
    CheckpointState,
    read_checkpoint,
    resolve_checkpoint,
)
from puma.config import Config, to_dict

if TYPE_CHECKING:  # torch on first use, as in puma.checkpoint.files
    import torch


def load_trainable(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: str = "") -> None:
    """Load trainable weights into ``model``; every trainable tensor must be present and match."""
    from puma.models.trainable import trainable_state_dict

    expected = trainable_state_dict(model)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(model.state_dict()))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {source} does not match the model built from its config: "
                              f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                              f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    model.load_state_dict(weights, strict=False)


PROBE_SEED, PROBE_BATCH = 1234, 2


def probe_images(img_size: int) -> torch.Tensor:
    """A fixed batch (2, 3, H, W) whose embeddings are stored with a checkpoint as its fingerprint."""
    import torch

    gen = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randn(PROBE_BATCH, 3, img_size, img_size, generator=gen)


def probe_embeddings(model: torch.nn.Module, img_size: int) -> list[list[float]]:
    """The eval-mode embeddings of :func:`probe_images` (restores the model's train/eval mode)."""
    import torch

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(probe_images(img_size).to(device)).float().cpu()
    model.train(was_training)
    return out.tolist()


def verify_probe(model: torch.nn.Module, meta: dict, img_size: int, source: str, atol: float = 1e-4) -> None:
    """Check that a reloaded model reproduces the embeddings stored at save time."""
    import torch

    if "probe" not in meta:
        return
    expected = torch.tensor(meta["probe"])
    actual = torch.tensor(probe_embeddings(model, img_size))
    diff = float((expected - actual).abs().max())
    if diff > atol:
        backbone = meta.get("backbone_weights", "?")
        cause = (f"the frozen backbone weights ({backbone}) differ from the ones it was trained on; point "
                 "model.backbone.weights (embed.backbone_weights) at those" if "files" in meta else
                 f"either the frozen backbone weights ({backbone}) differ from the ones it was trained on, "
                 f"or its own {MODEL_FILE} was changed (this checkpoint predates file checksums)")
        raise CheckpointError(f"checkpoint {source} does not reproduce its embeddings (max diff {diff:.2e} > "
                              f"{atol:.0e}): {cause}")


def load_model(uri: str, backbone_weights: str | None = None,
               verify: bool = True) -> tuple[torch.nn.Module, Config]:
    """Rebuild the model from a checkpoint's config and load its trainable weights (eval mode).

    ``backbone_weights`` overrides where the frozen backbone comes from (e.g. a local copy); with
    ``verify`` the model must reproduce the probe embeddings saved with the checkpoint.
    """
    from puma.methods import build_model  # the method registry (torch, timm, every method): on first use

    state = read_checkpoint(uri)
    if backbone_weights:
        state.config.model.backbone.weights = backbone_weights
    model = build_model(state.config.model)
    load_trainable(model, state.model, source=uri)
    model.eval()
    if verify:
        verify_probe(model, state.meta, state.config.model.backbone.img_size, uri)
    return model, state.config


def checkpoint_id(uri: str, state: CheckpointState | None = None) -> str:
    """The model id an index records: ``sha256:`` of the trainable weights (model.safetensors), the
    model config (the backbone weights' location left out) and the probe embeddings (which
    fingerprint the frozen backbone); a copy of a checkpoint keeps its id.

    The model config is the one config.yaml recorded, not the typed config rebuilt from it, so
    config fields added to the code later (filled with their defaults on reading) leave the id of
    an older checkpoint, and every index built with it, unchanged."""
    import yaml

    uri = resolve_checkpoint(uri)
    state = state or read_checkpoint(uri, weights=False)
    recorded = yaml.safe_load(storage.read_text(storage.join(uri, CONFIG_FILE))) or {}
    model_cfg = recorded.get("model") or to_dict(state.config.model)
    model_cfg.get("backbone", {}).pop("weights", None)
    digest = hashlib.sha256(storage.read_bytes(storage.join(uri, MODEL_FILE)))
    digest.update(json.dumps(model_cfg, sort_keys=True).encode())
    digest.update(json.dumps(state.meta.get("probe"), sort_keys=True).encode())
    return "sha256:" + digest.hexdigest()

