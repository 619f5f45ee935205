"""VPTSP-G (Ren et al., "Learning Semantic Proxies from Visual Prompts", ICLR 2024): the method.

The model pieces are in puma/models/vptspg.py (image path, proxy path, GRU / EMA fusion), the loss
in puma/losses/semantic_proxy.py (Eq. 2, 8), the class-prompt bank in puma/losses/memory_bank.py
(section 4.4); this record puts them together. Per step, on the global batch:

    classes = unique(all-gathered labels)             the global batch's K classes (every rank)
    t       = bank.gather(classes)                    (K, CLS-L, m, D) leaf on the device
    x       = model(images)                           image path (B, E)
    p       = model.semantic_proxies(images, t[idx])  proxy path (B, E), idx = each sample's class
    loss    = SemanticProxyLoss(gather(x), gather(p), gather(labels), model.fuse)
    after backward: bank.step(...)                    AdamW on the K rows, lr of the "modules" group

It trains with Proxy-Anchor against its semantic proxies only (``loss.name=proxy_anchor``), and
with ``model.vptsp_g.bitfit`` also every backbone bias (the paper's "(B)" rows).
"""

from __future__ import annotations

import torch
from torch import nn

from puma.config import Config, ConfigError, ModelConfig
from puma.distributed import gather_labels, gather_with_grad
from puma.losses.memory_bank import ClassPromptBank
from puma.losses.semantic_proxy import SemanticProxyLoss
from puma.methods.method import Method, TrainModule, refuse_data_init
from puma.models.backbone import create_backbone
from puma.models.head import EmbeddingHead
from puma.models.puma_model import PumaModel
from puma.models.vpt import build_visual_prompts
from puma.models.vptspg import (
    ProxyHead,
    SemanticProxyGRU,
    VptspgModel,
    class_prompt_init_bound,
    init_class_prompts,
)

BANK_LR_GROUP = "modules"  # class prompts train at the prompts' rate (optim.lr x module_lr_mult)


def build(cfg: ModelConfig) -> VptspgModel:
    """VPTSP-G (fusion gru) or VPTSP-M (fusion ema) from ``cfg.vptsp_g``."""
    vc = cfg.vptsp_g
    backbone = create_backbone(cfg.backbone)
    depth = len(backbone.blocks)
    if vc.prompt_layers is not None and vc.prompt_layers > depth:
        raise ConfigError(f"model.vptsp_g.prompt_layers={vc.prompt_layers} exceeds the backbone depth "
                          f"{depth}")
    prompts = build_visual_prompts(backbone, vc.prompt_length, deep=True)
    if vc.prompt_layers is not None:
        prompts.prompts = nn.Parameter(prompts.prompts.data[:vc.prompt_layers].clone())  # (L, N, D)
    dim, embed_dim = backbone.embed_dim, cfg.head.embed_dim
    fusion = SemanticProxyGRU(embed_dim, vc.gru_activation) if vc.fusion == "gru" else None
    return VptspgModel(backbone, EmbeddingHead(dim, embed_dim), prompts, ProxyHead(dim, embed_dim), fusion,
                       vc.class_prompt_layers, vc.class_prompt_length, vc.ema_lambda, vc.bitfit)


class VptspgTrainModule(TrainModule):
    """Model + semantic-proxy loss (which holds the class-prompt bank, outside DDP's parameters)."""

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        labels_all = gather_labels(labels)  # (B_global,)
        classes = torch.unique(labels_all)  # (K,) sorted
        class_prompts = self.loss.class_prompts.gather(classes)  # (K, CLS-L, m, D)
        emb = self.model(images)  # (B, E)
        proxies = self.model.semantic_proxies(images, class_prompts[torch.searchsorted(classes, labels)])
        return self.objective(self.loss(gather_with_grad(emb.float()), gather_with_grad(proxies.float()),
                                        labels_all, self.model.fuse))

    def after_backward(self, optimizer: torch.optim.Optimizer, clip_value: float, grad_scale: float) -> None:
        """AdamW for the gathered class prompts, with the hyper-parameters of the prompts' group."""
        named = [g for g in optimizer.param_groups if g.get("name") == BANK_LR_GROUP]
        group = (named or optimizer.param_groups)[0]
        self.loss.class_prompts.step(lr=group["lr"], weight_decay=group["weight_decay"], betas=group["betas"],
                                     eps=group["eps"], clip_value=clip_value, grad_scale=grad_scale)


def train_module(cfg: Config, model: VptspgModel, num_classes: int) -> VptspgTrainModule:
    """The bank (seeded by train.seed), the loss holding it, and the train module."""
    if not isinstance(model, VptspgModel):
        raise TypeError(f"model.method=vptsp_g needs a VptspgModel; got {type(model).__name__}")
    vc = cfg.model.vptsp_g
    table = init_class_prompts(num_classes, model.class_prompt_shape, class_prompt_init_bound(model.backbone),
                               seed=cfg.train.seed)
    bank = ClassPromptBank(table, offload=vc.memory_bank)
    loss = SemanticProxyLoss(num_classes, cfg.model.head.embed_dim, vc.proxy_bias_ratio, bank,
                             seed=cfg.train.seed)
    return VptspgTrainModule(model, loss)


def bitfit_parts(model: PumaModel) -> tuple[str, ...]:
    """``model.vptsp_g.bitfit``: the backbone biases train too."""
    return ("backbone_biases",) if getattr(model, "bitfit", False) else ()


def check_config(cfg: Config) -> None:
    """VPTSP-G trains with Proxy-Anchor against its semantic proxies, nothing else."""
    if cfg.loss.name != "proxy_anchor":
        raise ConfigError(f"model.method=vptsp_g trains with Proxy-Anchor against its semantic proxies; set "
                          f"loss.name=proxy_anchor (got {cfg.loss.name!r})")
    refuse_data_init(cfg, head=False, proxies=True)  # its proxies are generated, not learned per class


VPTSP_G = Method(name="vptsp_g", build=build,
                 trainable=("vpt_prompts", "class_prompts", "proxy_head", "gru", "head"),
                 option_parts=bitfit_parts, train_module=train_module, check_config=check_config)
