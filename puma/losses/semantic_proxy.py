"""VPTSP-G's loss: semantic proxies fused into a proxy memory, the proxy bias, Proxy-Anchor (Eq. 2-8).

For a global batch of embeddings x (B, E), semantic proxies p (B, E) and labels y (B,):

1. Fusion (section 4.3): the samples of each class c are fed in random order, one recurrent step
   each, into its memory P^c: P^c <- fuse(p_i, P^c) (GRU, Eq. 4-7, or EMA, Eq. 3). The chain keeps
   its gradient inside the batch; "we do not pass the gradient between the iterations or batches",
   so the memory enters each step detached and is stored detached. A class never seen has P^c = 0
   (a zero GRU state; EMA then starts at normal(p)).
2. Proxy bias (Eq. 8): Q^c = normal((1 - alpha) P^c + alpha O^c) for every class, O the original,
   randomly initialised proxies (kaiming-uniform over the class dimension, as PA here). Classes not
   in the batch use their stored P^c, so only O moves them ("outside the mini-batch, we would update
   the bias", appendix A.3).
3. Proxy-Anchor (Kim et al. 2020, Eq. 2) of x against Q: margin 0.1, alpha 32, as puma's
   ``proxy_anchor`` (equal to pytorch-metric-learning's ProxyAnchorLoss for the same proxies).

The loss holds the class-prompt bank (``class_prompts``): it is state of the training, not of the
model, and lives outside DDP; its tensors are saved and loaded with this module's state_dict
(keys ``class_prompts.*``, and the feeding-order generator's state), so checkpoints carry it as
safetensors like the proxies, and a resumed run continues exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from puma.losses.checks import check_embeddings_labels

PA_MARGIN, PA_ALPHA = 0.1, 32.0
BANK_PREFIX = "class_prompts."
ORDER_RNG_KEY = "feeding_order_rng"  # the generator state of the feeding order (exact resume)
Fuse = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def proxy_anchor_loss(embeddings: torch.Tensor, proxies: torch.Tensor, labels: torch.Tensor,
                      margin: float = PA_MARGIN, alpha: float = PA_ALPHA) -> torch.Tensor:
    """Eq. 2: (B, E) x (C, E) unit vectors, labels (B,) -> scalar.

    mean over proxies with positives of softplus(logsumexp(-alpha (s - margin)) over positives) +
    mean over all C proxies of softplus(logsumexp(alpha (s + margin)) over negatives).
    """
    cos = embeddings @ proxies.t()  # (B, C)
    pos = F.one_hot(labels, proxies.shape[0]).bool()  # (B, C)
    neg_inf = torch.finfo(cos.dtype).min
    pos_lse = torch.where(pos, -alpha * (cos - margin), neg_inf).logsumexp(dim=0)  # (C,)
    neg_lse = torch.where(~pos, alpha * (cos + margin), neg_inf).logsumexp(dim=0)  # (C,)
    with_pos = pos.any(dim=0)  # (C,) P+
    pos_term = F.softplus(pos_lse[with_pos]).sum() / with_pos.sum().clamp(min=1)
    return pos_term + F.softplus(neg_lse).sum() / proxies.shape[0]


def within_class_order(labels: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random feeding order: (perm (B,), classes (K,), slot (B,) class index, step (B,) position in class)."""
    perm = torch.randperm(labels.shape[0], generator=generator).to(labels.device)
    classes, slot = torch.unique(labels[perm], return_inverse=True)  # (K,), (B,)
    onehot = F.one_hot(slot, classes.shape[0])  # (B, K)
    step = (onehot.cumsum(dim=0) * onehot).sum(dim=1) - 1  # (B,) 0 for a class's first sample
    return perm, classes, slot, step


def fuse_batch(proxies: torch.Tensor, labels: torch.Tensor, memory: torch.Tensor, fuse: Fuse,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Fuse each class's semantic proxies (B, E) into its memory row in random order.

    Returns (classes (K,), fused P^c (K, E) with gradient through this batch's proxies only).
    """
    perm, classes, slot, step = within_class_order(labels, generator)
    proxies = proxies[perm]
    state = memory[classes].detach()  # (K, E): no gradient between iterations
    for i in range(int(step.max()) + 1):  # one batched recurrent step per position in the class
        sel = step == i
        rows = slot[sel]  # (K_i,) distinct classes
        state = state.index_copy(0, rows, fuse(proxies[sel], state[rows]))
    return classes, state


class SemanticProxyLoss(nn.Module):
    """forward(x (B, E), p (B, E), labels (B,), fuse) -> Proxy-Anchor of x against Q (Eq. 8)."""

    def __init__(self, num_classes: int, embed_dim: int, proxy_bias_ratio: float, class_prompts: Any = None,
                 seed: int = 0) -> None:
        super().__init__()
        self.num_classes, self.embed_dim = num_classes, embed_dim
        self.proxy_bias_ratio = proxy_bias_ratio  # alpha
        self.proxies = nn.Parameter(torch.empty(num_classes, embed_dim))  # O (C, E)
        nn.init.kaiming_uniform_(self.proxies, mode="fan_out")  # bound sqrt(6 / C), as puma's PA
        self.register_buffer("memory", torch.zeros(num_classes, embed_dim))  # P (C, E)
        self.generator = torch.Generator().manual_seed(seed)  # feeding order, the same on every rank
        self.class_prompts = class_prompts  # the bank (a plain object: outside DDP)
        self.register_state_dict_post_hook(_save_bank)
        self.register_load_state_dict_pre_hook(_load_bank)

    def proxy_parameters(self) -> list[nn.Parameter]:
        """O, the proxy bias: the optimiser's "proxies" group."""
        return [self.proxies]

    def forward(self, embeddings: torch.Tensor, proxies: torch.Tensor, labels: torch.Tensor,
                fuse: Fuse) -> torch.Tensor:
        check_embeddings_labels(embeddings, labels, self.embed_dim, self.num_classes)
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            classes, fused = fuse_batch(proxies.float(), labels, self.memory, fuse, self.generator)
            with torch.no_grad():
                self.memory[classes] = fused.detach()
            memory = self.memory.detach().index_copy(0, classes, fused)  # (C, E), grad on the batch's rows
            alpha = self.proxy_bias_ratio
            q = F.normalize((1 - alpha) * memory + alpha * self.proxies, dim=-1)  # Eq. 8 (C, E)
            return proxy_anchor_loss(embeddings.float(), q, labels)

    def extra_repr(self) -> str:
        return f"num_classes={self.num_classes}, embed_dim={self.embed_dim}, alpha={self.proxy_bias_ratio}"


def _save_bank(module: SemanticProxyLoss, state: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict hook: add the bank's tensors under ``class_prompts.`` and the generator state."""
    state[prefix + ORDER_RNG_KEY] = module.generator.get_state()  # uint8 tensor
    if module.class_prompts is not None:
        for key, value in module.class_prompts.state_dict().items():
            state[prefix + BANK_PREFIX + key] = value


def _load_bank(module: SemanticProxyLoss, state: dict, prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook: hand the ``class_prompts.`` tensors to the bank."""
    if prefix + ORDER_RNG_KEY in state:
        module.generator.set_state(state.pop(prefix + ORDER_RNG_KEY))
    start = prefix + BANK_PREFIX
    bank = {k[len(start):]: state.pop(k) for k in [k for k in state if k.startswith(start)]}
    if bank and module.class_prompts is not None:
        module.class_prompts.load_state_dict(bank)
