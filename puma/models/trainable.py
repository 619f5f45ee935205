"""The one place that decides what trains: the backbone is frozen; adapters, prompts and head train.

Parameter groups (for puma.optim.build_optimizer):

    backbone   trainable backbone weights (none for PUMA)
    modules    adapters and the prompt pool
    head       the embedding head
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from puma.models.adapter import StochasticAdapter
from puma.models.backbone import freeze_backbone
from puma.models.prompt_pool import PromptPool
from puma.models.puma_model import PumaModel

PEFT_MODULE_TYPES: tuple[type[nn.Module], ...] = (StochasticAdapter, PromptPool)


def peft_modules(model: nn.Module) -> Iterator[nn.Module]:
    """The adapter and prompt-pool modules inside ``model``."""
    return (m for m in model.modules() if isinstance(m, PEFT_MODULE_TYPES))


def mark_trainable(model: PumaModel) -> None:
    """Freeze the backbone; make adapters, prompt pool and head trainable."""
    freeze_backbone(model.backbone)
    model.requires_grad_(False)  # anything not listed below stays frozen too
    for module in peft_modules(model):
        module.requires_grad_(True)
    model.head.requires_grad_(True)


def trainable_parameter_groups(model: PumaModel) -> dict[str, list[nn.Parameter]]:
    """Trainable parameters split into "backbone", "modules" and "head"."""
    modules = {id(p) for m in peft_modules(model) for p in m.parameters()}
    head = {id(p) for p in model.head.parameters()}
    groups: dict[str, list[nn.Parameter]] = {"backbone": [], "modules": [], "head": []}
    for p in model.parameters():
        if p.requires_grad:
            groups["head" if id(p) in head else "modules" if id(p) in modules else "backbone"].append(p)
    return groups


def trainable_names(model: nn.Module) -> list[str]:
    """state_dict key names of the trainable parameters."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def trainable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the trainable tensors, keyed as in ``model.state_dict()``."""
    names = set(trainable_names(model))
    return {k: v for k, v in model.state_dict().items() if k in names}


def count_trainable(model: nn.Module) -> int:
    """Number of trainable scalars."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
