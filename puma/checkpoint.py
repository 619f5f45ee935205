"""Checkpoints: a directory (local or s3://) that describes itself and never needs unpickling.

Layout::

    model.safetensors      trainable weights only (keys as in model.state_dict())
    loss.safetensors       loss parameters and buffers (proxies, CurricularFace t)
    optimizer.safetensors  optimiser tensors (resume only; optional)
    config.yaml            the resolved Config
    meta.json              epoch, metrics, label map, library versions, optimiser layout, sha256 of
                           each .safetensors file (a file changed after saving is refused)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from puma import library_versions, storage
from puma.config import Config, dump_yaml, from_dict, run_uri, to_dict
from puma.errors import UserError

MODEL_FILE = "model.safetensors"
LOSS_FILE = "loss.safetensors"
OPTIM_FILE = "optimizer.safetensors"
CONFIG_FILE = "config.yaml"
META_FILE = "meta.json"
BEST_DIR = "best"  # <run>/best: the best checkpoint by train.best_metric
# the libraries that shape a checkpoint's meaning (meta.json "versions")
LIBRARIES = ("torch", "timm", "ray", "pytorch-metric-learning", "faiss-cpu", "faiss-gpu", "puma-ray")


class CheckpointError(UserError, ValueError):
    """A checkpoint is missing, incomplete or does not match the model built from its config."""


@dataclass
class CheckpointState:
    """What a checkpoint holds, in memory."""

    config: Config
    model: dict[str, torch.Tensor]
    loss: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def _cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}


def save_checkpoint(uri: str, state: CheckpointState) -> str:
    """Write ``state`` under ``uri``; meta.json is written last, so its presence marks completeness."""
    storage.makedirs(uri)
    weights = {MODEL_FILE: st_save(_cpu(state.model)), LOSS_FILE: st_save(_cpu(state.loss))}
    for name, data in weights.items():
        storage.write_bytes(storage.join(uri, name), data)
    meta = dict(state.meta, versions=library_versions(LIBRARIES),
                sha256={name: storage.sha256(data) for name, data in weights.items()})
    if state.optimizer is not None:
        tensors, layout = flatten_optimizer_state(state.optimizer)
        data = st_save(tensors)
        storage.write_bytes(storage.join(uri, OPTIM_FILE), data)
        meta["optimizer_layout"] = layout
        meta["sha256"][OPTIM_FILE] = storage.sha256(data)
    storage.write_text(storage.join(uri, CONFIG_FILE), dump_yaml(state.config))
    storage.write_text(storage.join(uri, META_FILE), json.dumps(meta, indent=2, sort_keys=True))
    return uri


def read_checkpoint(uri: str, with_optimizer: bool = False) -> CheckpointState:
    """Read a checkpoint written by :func:`save_checkpoint` (safetensors + YAML + JSON only)."""
    if not storage.exists(storage.join(uri, META_FILE)):
        raise CheckpointError(f"{uri} is not a complete PUMA checkpoint: {META_FILE} is missing "
                              f"(expected files: {MODEL_FILE}, {CONFIG_FILE}, {META_FILE})")
    meta = _read_meta(uri)
    config = _read_config(uri)
    model = read_weights(uri, MODEL_FILE, meta)
    loss = read_weights(uri, LOSS_FILE, meta)
    optimizer = None
    if with_optimizer and "optimizer_layout" in meta:
        tensors = read_weights(uri, OPTIM_FILE, meta)
        optimizer = unflatten_optimizer_state(tensors, meta["optimizer_layout"])
    return CheckpointState(config=config, model=model, loss=loss, optimizer=optimizer, meta=meta)


def _read_meta(uri: str) -> dict[str, Any]:
    """meta.json as a dict; an unreadable one is a CheckpointError naming it."""
    path = storage.join(uri, META_FILE)
    try:
        meta = json.loads(storage.read_text(path))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}): the checkpoint is damaged; use another "
                              "checkpoint (e.g. an earlier checkpoint_* of the run)") from exc
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} holds a {type(meta).__name__}, not a JSON object: the checkpoint is "
                              "damaged; use another checkpoint")
    return meta


def _read_config(uri: str) -> Config:
    """config.yaml as a Config; a missing or unreadable one is a CheckpointError naming it."""
    import yaml

    path = storage.join(uri, CONFIG_FILE)
    try:
        return from_dict(yaml.safe_load(storage.read_text(path)) or {})
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is missing: {uri} is not a complete PUMA checkpoint") from exc
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid YAML: the checkpoint is damaged; use another "
                              "checkpoint") from exc


def read_weights(uri: str, name: str, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One safetensors file of a checkpoint; a missing, truncated, corrupt or edited file is refused.

    A checkpoint written since file checksums were recorded (meta.json ``sha256``) must still hold
    the bytes it was saved with: a file changed afterwards is named as such (truncated or corrupt if
    it no longer parses, edited if it does), not blamed on the backbone later.
    """
    path = storage.join(uri, name)
    try:
        data = storage.read_bytes(path)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is missing: {uri} is not a complete PUMA checkpoint") from exc
    try:
        tensors = st_load(data)
    except SafetensorError as exc:
        raise CheckpointError(f"{path} is truncated or corrupt ({len(data)} bytes; safetensors: {exc}): use "
                              "another checkpoint (e.g. an earlier checkpoint_* of the run)") from exc
    recorded = meta.get("sha256", {}).get(name)
    if recorded and storage.sha256(data) != recorded:
        raise CheckpointError(f"{path} was changed after the checkpoint was saved (its sha256 differs from "
                              f"the one in {META_FILE}): its weights are not the trained ones; restore the "
                              "file or use another checkpoint")
    return tensors


def flatten_optimizer_state(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split a torch optimiser state_dict into safetensors-ready tensors and a JSON layout."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, pstate in state_dict["state"].items():
        for key, value in pstate.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{key}"] = value.detach().to("cpu").contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], layout: dict) -> dict:
    """Inverse of :func:`flatten_optimizer_state`."""
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    for pid, values in layout.get("scalars", {}).items():
        state.setdefault(int(pid), {}).update(values)
    return {"state": state, "param_groups": layout["param_groups"]}


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
    gen = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randn(PROBE_BATCH, 3, img_size, img_size, generator=gen)


@torch.no_grad()
def probe_embeddings(model: torch.nn.Module, img_size: int) -> list[list[float]]:
    """The eval-mode embeddings of :func:`probe_images` (restores the model's train/eval mode)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = model(probe_images(img_size).to(device)).float().cpu()
    model.train(was_training)
    return out.tolist()


def verify_probe(model: torch.nn.Module, meta: dict, img_size: int, source: str, atol: float = 1e-4) -> None:
    """Check that a reloaded model reproduces the embeddings stored at save time."""
    if "probe" not in meta:
        return
    expected = torch.tensor(meta["probe"])
    actual = torch.tensor(probe_embeddings(model, img_size))
    diff = float((expected - actual).abs().max())
    if diff > atol:
        backbone = meta.get("backbone_weights", "?")
        cause = (f"the frozen backbone weights ({backbone}) differ from the ones it was trained on; point "
                 "model.backbone.weights (embed.backbone_weights) at those" if "sha256" in meta else
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
    fingerprint the frozen backbone); a copy of a checkpoint keeps its id."""
    state = state or read_checkpoint(uri)
    model_cfg = to_dict(state.config.model)
    model_cfg["backbone"].pop("weights", None)
    digest = hashlib.sha256(storage.read_bytes(storage.join(uri, MODEL_FILE)))
    digest.update(json.dumps(model_cfg, sort_keys=True).encode())
    digest.update(json.dumps(state.meta.get("probe"), sort_keys=True).encode())
    return "sha256:" + digest.hexdigest()


def best_checkpoint_uri(cfg: Config) -> str:
    """Where training keeps its best checkpoint: <train.storage_path>/<train.run_name>/best."""
    return storage.join(run_uri(cfg), BEST_DIR)
