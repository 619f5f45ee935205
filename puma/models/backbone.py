"""The frozen backbone: any timm VisionTransformer by name, weights from the hub, a file/URI, or none.

Weight files (local or ``s3://``, read through :mod:`puma.storage`):

    *.safetensors   a timm state dict
    *.pth, *.pt     a timm state dict, read with ``torch.load(weights_only=True)`` (never unpickled)
    *.npz           an original JAX/Flax (augreg) checkpoint, read by timm's npz loader

State dicts load strict: a missing, unexpected or mis-shaped key is an error that names it. A stored
``pos_embed`` on another grid (e.g. DINOv2 at 518 px = 37x37, model at 224 px = 16x16) is resampled
bicubically; the classifier keys of a checkpoint are dropped (the backbone has ``num_classes=0``).
"""

from __future__ import annotations

import io
import math
import pickle

import timm
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors
from timm.layers import resample_abs_pos_embed
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from puma import storage
from puma.config import BackboneConfig, ConfigError
from puma.errors import UserError

WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".npz")
OFFLINE_HINT = ("offline, set model.backbone.weights to a .safetensors/.pth/.npz file or URI, e.g. the "
                "offline DINOv2 ViT-S/14 (name vit_small_patch14_dinov2) written by "
                "`python -m puma.models.offline`")
# DINOv2 resamples its 37x37 grid without antialiasing when it runs at 224 px; do the same.
POS_EMBED_INTERPOLATION = "bicubic"
POS_EMBED_ANTIALIAS = False
RANDOM_INIT_SEED = 0  # a frozen random backbone (weights "none") is reproducible, so are its checkpoints
_RESERVED_KWARGS = ("pretrained", "num_classes", "img_size")
NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)


class BackboneWeightsError(UserError, ValueError):
    """Backbone weights could not be fetched, read or matched to the model; the message says why."""


def create_backbone(cfg: BackboneConfig) -> VisionTransformer:
    """A timm ViT with ``num_classes=0`` at ``cfg.img_size``, weights as ``cfg.weights`` says."""
    bad = sorted(set(cfg.model_kwargs) & set(_RESERVED_KWARGS))
    if bad:
        raise ConfigError(f"model.backbone.model_kwargs may not set {bad}; use model.backbone.img_size / "
                          "model.backbone.weights instead")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RANDOM_INIT_SEED)  # weights "none": the same random backbone every time
        vit = _create(cfg, pretrained=cfg.weights == "hub")
    if cfg.weights not in ("hub", "none"):
        load_backbone_weights(vit, cfg.weights)
    return vit


def _create(cfg: BackboneConfig, pretrained: bool) -> VisionTransformer:
    """timm.create_model with clear errors for unknown names, non-ViTs and an unreachable hub."""
    if not timm.is_model(cfg.name):
        raise ConfigError(f"model.backbone.name={cfg.name!r} is not a timm model; list ViTs with "
                          "timm.list_models('vit_*') or timm.list_models('deit*')")
    try:
        vit = timm.create_model(cfg.name, pretrained=pretrained, num_classes=0, img_size=cfg.img_size,
                                **cfg.model_kwargs)
    except TypeError as exc:  # a non-ViT (no img_size) or a bad model_kwargs entry
        raise ConfigError(f"timm cannot build {cfg.name!r} with img_size={cfg.img_size} and model_kwargs="
                          f"{cfg.model_kwargs}: {exc}; PUMA needs a timm VisionTransformer") from exc
    except (OSError, RuntimeError) as exc:  # hub unreachable / no cached file
        if not pretrained:
            raise
        raise BackboneWeightsError(f"could not fetch pretrained weights for {cfg.name!r} from the hub "
                                   f"({type(exc).__name__}: {exc}); {OFFLINE_HINT}") from exc
    if not isinstance(vit, VisionTransformer):
        raise ConfigError(f"model.backbone.name={cfg.name!r} builds a {type(vit).__name__}; PUMA needs a "
                          "timm VisionTransformer (ViT, DeiT, DINO, DINOv2 ...)")
    return vit


def freeze_backbone(vit: nn.Module) -> None:
    """Freeze every parameter of ``vit`` (call before adding trainable modules, or re-enable them)."""
    vit.requires_grad_(False)


def set_norms_eval(module: nn.Module) -> None:
    """Put every normalisation layer inside ``module`` in eval mode (frozen statistics)."""
    for m in module.modules():
        if isinstance(m, NORM_TYPES):
            m.eval()


# ----------------------------------------------------------------------------- weight files


def check_weights_file(uri: str) -> None:
    """Refuse, before any worker loads it, a weights file that is missing, of an unknown type, or a
    truncated or corrupt safetensors file (its header and size are checked, no tensor is read)."""
    if uri in ("hub", "none"):
        return
    if not any(uri.lower().endswith(s) for s in WEIGHT_SUFFIXES):
        raise BackboneWeightsError(f"model.backbone.weights={uri!r}: unknown file type; valid: 'hub', "
                                   f"'none' or a file/URI ending in {list(WEIGHT_SUFFIXES)}")
    if not storage.exists(uri):
        raise BackboneWeightsError(f"model.backbone.weights={uri!r} does not exist; for the offline DINOv2 "
                                   "backbone run `python -m puma.models.offline` (scripts/setup.sh does)")
    if storage.is_s3(uri) or not uri.lower().endswith(".safetensors"):
        return  # read in full by each worker; an S3 object is not fetched twice here
    try:
        with safe_open(storage.resolve(uri)[1], "pt"):
            pass
    except (SafetensorError, OSError) as exc:
        raise BackboneWeightsError(f"model.backbone.weights={uri!r} is truncated or corrupt "
                                   f"(safetensors: {exc}); convert or copy it again") from exc


def load_backbone_weights(vit: VisionTransformer, uri: str) -> None:
    """Load a weight file/URI into ``vit`` in place (strict; pos_embed resampled to the model's grid)."""
    suffix = next((s for s in WEIGHT_SUFFIXES if uri.lower().endswith(s)), None)
    if suffix is None:
        raise BackboneWeightsError(f"model.backbone.weights={uri!r}: unknown file type; valid: 'hub', "
                                   f"'none' or a file/URI ending in {list(WEIGHT_SUFFIXES)}")
    try:
        data = storage.read_bytes(uri)
    except OSError as exc:
        raise BackboneWeightsError(f"cannot read backbone weights {uri!r}: {exc}") from exc
    if suffix == ".npz":
        _load_npz(vit, data, uri)
        return
    state = read_state_dict(data, suffix, uri)
    load_state_dict_strict(vit, state, uri)


def read_state_dict(data: bytes, suffix: str, uri: str = "<bytes>") -> dict[str, torch.Tensor]:
    """Tensors from safetensors or torch-saved bytes (``weights_only``: no arbitrary unpickling)."""
    try:
        if suffix == ".safetensors":
            state = load_safetensors(data)
        else:
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (SafetensorError, pickle.UnpicklingError, RuntimeError, ValueError, EOFError, OSError) as exc:
        what = "safetensors" if suffix == ".safetensors" else "torch weights-only (no pickled objects)"
        raise BackboneWeightsError(f"{uri}: not a readable {what} file: {exc}") from exc
    return _unwrap(state, uri)


def _unwrap(state: object, uri: str) -> dict[str, torch.Tensor]:
    """The state dict inside a checkpoint (``{'model': ...}`` / ``{'state_dict': ...}`` are unwrapped)."""
    for key in ("model", "state_dict"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise BackboneWeightsError(f"{uri}: expected a mapping of tensor names to tensors, "
                                   f"got {type(state).__name__}")
    return dict(state)


def load_state_dict_strict(vit: VisionTransformer, state: dict[str, torch.Tensor], uri: str) -> None:
    """Strict load after dropping classifier keys and resampling ``pos_embed``; errors name the keys."""
    state = _drop_classifier(vit, state)
    if "pos_embed" in state and vit.pos_embed is not None:
        state["pos_embed"] = resample_pos_embed(vit, state["pos_embed"], uri)
    expected = vit.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = [f"{k}: file {tuple(state[k].shape)} vs model {tuple(v.shape)}"
                  for k, v in expected.items() if k in state and state[k].shape != v.shape]
    if missing or unexpected or mismatched:
        raise BackboneWeightsError(
            f"{uri} does not match timm model {type(vit).__name__} "
            f"(depth {len(vit.blocks)}, dim {vit.embed_dim}): missing keys {_few(missing)}, "
            f"unexpected keys {_few(unexpected)}, shape mismatches {_few(mismatched)}; "
            "check model.backbone.name / model_kwargs against the file")
    vit.load_state_dict(state, strict=True)


def _few(items: list[str], n: int = 8) -> str:
    return str(items[:n]) + (f" (+{len(items) - n} more)" if len(items) > n else "")


def _drop_classifier(vit: VisionTransformer, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the checkpoint's classifier tensors (``head.*``, ``head_dist.*``) the headless model lacks."""
    names = vit.pretrained_cfg.get("classifier") or "head"
    prefixes = tuple(f"{n}." for n in ((names,) if isinstance(names, str) else names))
    own = set(vit.state_dict())
    return {k: v for k, v in state.items() if k in own or not k.startswith(prefixes)}


def resample_pos_embed(vit: VisionTransformer, pos_embed: torch.Tensor, uri: str = "") -> torch.Tensor:
    """Stored (1, prefix + Hs*Ws, D) position table resampled to the model's (1, prefix + H*W, D)."""
    if pos_embed.shape == vit.pos_embed.shape:
        return pos_embed
    num_prefix = 0 if vit.no_embed_class else vit.num_prefix_tokens
    side = math.isqrt(pos_embed.shape[1] - num_prefix)
    if pos_embed.ndim != 3 or side * side != pos_embed.shape[1] - num_prefix:
        raise BackboneWeightsError(f"{uri}: pos_embed {tuple(pos_embed.shape)} is not {num_prefix} prefix "
                                   f"token(s) + a square grid; model expects {tuple(vit.pos_embed.shape)}")
    return resample_abs_pos_embed(pos_embed, new_size=list(vit.patch_embed.grid_size), old_size=[side, side],
                                  num_prefix_tokens=num_prefix, interpolation=POS_EMBED_INTERPOLATION,
                                  antialias=POS_EMBED_ANTIALIAS)


def _load_npz(vit: VisionTransformer, data: bytes, uri: str) -> None:
    """An original JAX/Flax ViT checkpoint via timm's loader (it resamples pos_embed itself)."""
    try:
        with torch.no_grad():
            vit.load_pretrained(io.BytesIO(data))
    except (KeyError, ValueError, RuntimeError, OSError) as exc:
        raise BackboneWeightsError(f"{uri}: not a JAX/Flax ViT checkpoint matching timm model "
                                   f"{type(vit).__name__} (depth {len(vit.blocks)}, dim {vit.embed_dim}): "
                                   f"{type(exc).__name__}: {exc}") from exc
