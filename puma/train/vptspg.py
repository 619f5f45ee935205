"""VPTSP-G's training step: image path + proxy path on the global batch, and the class-prompt bank.

Built by ``puma.train.step.build_train_module`` for ``model.method: vptsp_g``. Per step:

    classes = unique(all-gathered labels)             the global batch's K classes (every rank)
    t       = bank.gather(classes)                    (K, CLS-L, m, D) leaf on the device
    x       = model(images)                           image path (B, E)
    p       = model.semantic_proxies(images, t[idx])  proxy path (B, E), idx = each sample's class
    loss    = SemanticProxyLoss(gather(x), gather(p), gather(labels), model.fuse)
    after backward: bank.step(...)                    AdamW on the K rows, lr of the "modules" group

The model and the loss know nothing of ranks; gathering is step.py's, averaging the bank's rows
memory_bank.py's.
"""

from __future__ import annotations

import torch

from puma.config import Config
from puma.losses.semantic_proxy import SemanticProxyLoss
from puma.models.vptspg import VptspgModel, class_prompt_init_bound, init_class_prompts
from puma.train.memory_bank import ClassPromptBank
from puma.train.step import TrainModule, gather_labels, gather_with_grad

BANK_LR_GROUP = "modules"  # class prompts train at the prompts' rate (optim.lr x module_lr_mult)


class VptspgTrainModule(TrainModule):
    """Model + semantic-proxy loss (which holds the class-prompt bank, outside DDP's parameters)."""

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        labels_all = gather_labels(labels)  # (B_global,)
        classes = torch.unique(labels_all)  # (K,) sorted
        class_prompts = self.loss.class_prompts.gather(classes)  # (K, CLS-L, m, D)
        emb = self.model(images)  # (B, E)
        proxies = self.model.semantic_proxies(images, class_prompts[torch.searchsorted(classes, labels)])
        metric_loss = self.loss(gather_with_grad(emb.float()), gather_with_grad(proxies.float()), labels_all,
                                self.model.fuse)
        aux = self.model.aux_loss()
        return {"loss": metric_loss + aux, "metric_loss": metric_loss.detach(), "aux_loss": aux.detach()}

    def after_backward(self, optimizer: torch.optim.Optimizer, clip_value: float, grad_scale: float) -> None:
        """AdamW for the gathered class prompts, with the hyper-parameters of the prompts' group."""
        named = [g for g in optimizer.param_groups if g.get("name") == BANK_LR_GROUP]
        group = (named or optimizer.param_groups)[0]
        self.loss.class_prompts.step(lr=group["lr"], weight_decay=group["weight_decay"], betas=group["betas"],
                                     eps=group["eps"], clip_value=clip_value, grad_scale=grad_scale)


def build_vptspg_module(cfg: Config, model: VptspgModel, num_classes: int) -> VptspgTrainModule:
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
