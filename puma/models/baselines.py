"""The baselines of PUMA Table 2 and appendix B.4, selectable by ``model.method``.

Every method is a frozen timm ViT (final-norm CLS token) plus a 128-d L2-normalised head; they
differ in what is added to the backbone and what trains (decided in puma.models.trainable):

==============  ================================================  ================================
method          architecture (config sections it reads)            trains
==============  ================================================  ================================
puma            stochastic adapters + prompt pool, as enabled      adapters, prompt pool, head
                (adapter, prompt_pool)
linear          frozen backbone + Linear head (Linear Emb.)        head
mlp3            frozen backbone + 3-layer MLP head (MLP-3 Emb.)    head
vpt_shallow     Np prompt tokens at the input (vpt)                prompts, head
vpt_deep        Np fresh prompt tokens before every block (vpt)    prompts, head
lora            LoRA on the attention projections (lora)           LoRA branches, head
puma_lora       PUMA + LoRA (adapter, prompt_pool, lora)           adapters, pool, LoRA, head
adaptformer     PUMA's adapters with keep_prob = 1, no prompt      adapters, head
                pool (adapter: rank, scale, blocks)
bitfit          frozen backbone, bias terms unfrozen               backbone biases, head
full_finetune   the whole backbone trains (Table 2(a), 2(b))       every parameter
vptsp_g         VPTSP-G (ICLR 2024): deep visual prompts; class    prompts, proxy head, GRU,
                prompts -> semantic proxies (vptsp_g)              head, class prompts (bank),
                                                                   backbone biases (bitfit)
==============  ================================================  ================================

A method ignores the sections it does not read (``linear`` builds no adapters whatever
``model.adapter.enabled`` says; ``adaptformer`` is static by definition and ignores
``model.adapter.keep_prob``). Stochastic LoRA is ``lora`` / ``puma_lora`` with
``model.lora.keep_prob < 1``. The MLP-3 head follows the released code: Linear(D, 2048) - GELU -
Linear(2048, 2048) - GELU - Linear(2048, 128), no normalisation layers (5.25M parameters at ViT-S).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from puma.config import ModelConfig
from puma.models.adapter import inject_adapters
from puma.models.backbone import create_backbone
from puma.models.head import EmbeddingHead
from puma.models.lora import inject_lora
from puma.models.puma_model import METHODS, PumaModel, _build_puma
from puma.models.vpt import VptModel, build_visual_prompts
from puma.models.vptspg import build_vptspg

MLP_HIDDEN_DIM = 2048
MLP_LAYERS = 3


class MlpEmbeddingHead(EmbeddingHead):
    """(B, D) -> Linear-GELU x (layers - 1) -> Linear ``proj`` -> L2 normalise -> (B, embed_dim)."""

    def __init__(self, dim: int, embed_dim: int, hidden_dim: int = MLP_HIDDEN_DIM, layers: int = MLP_LAYERS):
        super().__init__(hidden_dim, embed_dim)  # proj: Linear(hidden_dim -> embed_dim), the last layer
        if layers < 2:
            raise ValueError(f"an MLP head needs layers >= 2 (1 is the linear head); got {layers}")
        widths = [dim] + [hidden_dim] * (layers - 1)
        hidden: list[nn.Module] = []
        for w_in, w_out in zip(widths[:-1], widths[1:], strict=True):
            hidden += [nn.Linear(w_in, w_out), nn.GELU()]
        self.mlp = nn.Sequential(*hidden)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return super().forward(self.mlp(features))  # (B, D) -> (B, hidden) -> (B, E)


def _plain(cfg: ModelConfig) -> PumaModel:
    """Backbone + linear head, nothing added (linear, bitfit and full_finetune differ in what trains)."""
    backbone = create_backbone(cfg.backbone)
    return PumaModel(backbone, EmbeddingHead(backbone.embed_dim, cfg.head.embed_dim))


def _mlp3(cfg: ModelConfig) -> PumaModel:
    backbone = create_backbone(cfg.backbone)
    return PumaModel(backbone, MlpEmbeddingHead(backbone.embed_dim, cfg.head.embed_dim))


def _vpt(cfg: ModelConfig, deep: bool) -> PumaModel:
    backbone = create_backbone(cfg.backbone)
    prompts = build_visual_prompts(backbone, cfg.vpt.length, deep)
    return VptModel(backbone, EmbeddingHead(backbone.embed_dim, cfg.head.embed_dim), prompts)


def _lora(cfg: ModelConfig) -> PumaModel:
    model = _plain(cfg)
    inject_lora(model.backbone, cfg.lora)
    return model


def _puma_lora(cfg: ModelConfig) -> PumaModel:
    model = _build_puma(cfg)
    inject_lora(model.backbone, cfg.lora)
    return model


def _adaptformer(cfg: ModelConfig) -> PumaModel:
    model = _plain(cfg)
    inject_adapters(model.backbone, dataclasses.replace(cfg.adapter, keep_prob=1.0))
    return model


BASELINES = {
    "linear": _plain,
    "mlp3": _mlp3,
    "vpt_shallow": lambda cfg: _vpt(cfg, deep=False),
    "vpt_deep": lambda cfg: _vpt(cfg, deep=True),
    "lora": _lora,
    "puma_lora": _puma_lora,
    "adaptformer": _adaptformer,
    "bitfit": _plain,
    "full_finetune": _plain,
    "vptsp_g": build_vptspg,  # puma/models/vptspg.py (model.vptsp_g)
}


def register_baselines() -> None:
    """Add the baselines to the METHODS registry (idempotent; done when puma.models is imported)."""
    METHODS.update(BASELINES)
