"""What can train: the named parts of a model, and the one function that makes exactly them trainable.

Each method declares the parts it trains in its record (``Method.trainable`` in
puma/methods/<name>.py); ``puma.methods.mark_trainable`` hands them to :func:`set_trainable`, and
nothing else changes ``requires_grad``. Parts and the optimiser group each lands in
(puma.optim.build_optimizer):

    part              what                                              group
    adapters          stochastic / static adapters (StochasticAdapter)  modules
    prompt_pool       PUMA's conditional prompt pool (PromptPool)       modules
    vpt_prompts       VPT prompt tokens (VisualPrompts)                 modules
    lora              LoRA branches (LoraBranch)                        modules
    proxy_head        VPTSP-G's proxy-tower head (ProxyHead)            modules
    gru               VPTSP-G's proxy fusion GRU (SemanticProxyGRU)     modules
    class_prompts     VPTSP-G's class-based prompts: no model           (own row-wise AdamW,
                      parameter; held by the ClassPromptBank            lr of "modules")
                      (puma/losses/memory_bank.py) outside the model
                      and DDP, only the batch's classes on the device
    head              the embedding head (linear or MLP)                head
    rotation_head     UDML-SS's 4-way rotation-prediction head          head
    backbone_biases   every bias of the backbone (BitFit)               backbone
    backbone          every backbone parameter (full fine-tuning)       backbone

Everything else is frozen. Full fine-tuning trains the LayerNorm weights too (the paper: "every
parameter in the backbone and the embedding layer is fully updated"; in the released code the
norm freeze is undone for every parameter in the optimiser when the backbone is not frozen);
LayerNorm has no running statistics, so PumaModel keeping norms in eval mode changes nothing.
BitFit's biases include the LayerNorm biases (Ben Zaken et al. 2022 tune every bias term).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from puma.config import ConfigError
from puma.models.adapter import StochasticAdapter
from puma.models.lora import LoraBranch
from puma.models.prompt_pool import PromptPool
from puma.models.puma_model import PumaModel
from puma.models.vpt import VisualPrompts
from puma.models.vptspg import ProxyHead, SemanticProxyGRU

PEFT_PARTS: dict[str, type[nn.Module]] = {
    "adapters": StochasticAdapter,
    "prompt_pool": PromptPool,
    "vpt_prompts": VisualPrompts,
    "lora": LoraBranch,
    "proxy_head": ProxyHead,
    "gru": SemanticProxyGRU,
}
PEFT_MODULE_TYPES: tuple[type[nn.Module], ...] = tuple(PEFT_PARTS.values())


def peft_modules(model: nn.Module,
                 types: tuple[type[nn.Module], ...] = PEFT_MODULE_TYPES) -> Iterator[nn.Module]:
    """The adapter, prompt, VPT and LoRA modules inside ``model`` (of ``types``)."""
    return (m for m in model.modules() if isinstance(m, types))


def _backbone_biases(model: PumaModel) -> Iterator[nn.Parameter]:
    peft = {id(p) for m in peft_modules(model.backbone) for p in m.parameters()}
    return (p for n, p in model.backbone.named_parameters() if n.endswith("bias") and id(p) not in peft)


def _backbone_weights(model: PumaModel) -> Iterator[nn.Parameter]:
    peft = {id(p) for m in peft_modules(model.backbone) for p in m.parameters()}
    return (p for p in model.backbone.parameters() if id(p) not in peft)


def _rotation_head(model: PumaModel) -> Iterator[nn.Parameter]:
    head = getattr(model, "rotation_head", None)
    if head is None:
        raise ConfigError(f"model.method={model.method!r} declares part 'rotation_head' but its model "
                          f"({type(model).__name__}) has none")
    return head.parameters()


PART_PARAMETERS: dict[str, Callable[[PumaModel], Iterable[nn.Parameter]]] = {
    **{part: (lambda m, t=t: (p for mod in peft_modules(m, (t,)) for p in mod.parameters()))
       for part, t in PEFT_PARTS.items()},
    "head": lambda m: m.head.parameters(),
    "rotation_head": _rotation_head,
    "backbone_biases": _backbone_biases,
    "backbone": _backbone_weights,
    "class_prompts": lambda m: (),  # held by the ClassPromptBank, not by the model (see above)
}
PARTS: tuple[str, ...] = tuple(PART_PARAMETERS)


def set_trainable(model: PumaModel, parts: tuple[str, ...]) -> None:
    """Freeze everything, then unfreeze exactly ``parts`` (names from PARTS) of ``model``."""
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ConfigError(f"model.method={model.method!r} declares unknown part(s) {unknown}; "
                          f"valid: {list(PARTS)}")
    _check_no_undeclared_modules(model, parts)
    model.requires_grad_(False)
    for part in parts:
        for p in PART_PARAMETERS[part](model):
            p.requires_grad_(True)


def _check_no_undeclared_modules(model: PumaModel, parts: tuple[str, ...]) -> None:
    """A PEFT module the method does not train would be dead weight: a builder/declaration mismatch."""
    for part, module_type in PEFT_PARTS.items():
        if part not in parts and any(True for _ in peft_modules(model, (module_type,))):
            raise ConfigError(f"model.method={model.method!r} built {module_type.__name__} modules but "
                              f"does not train {part!r}; its declared parts are {list(parts)}")
    if "rotation_head" not in parts and getattr(model, "rotation_head", None) is not None:
        raise ConfigError(f"model.method={model.method!r} built a rotation head but does not train "
                          f"'rotation_head'; its declared parts are {list(parts)}")


def trainable_parameter_groups(model: PumaModel) -> dict[str, list[nn.Parameter]]:
    """Trainable parameters split into "backbone", "modules" and "head"."""
    modules = {id(p) for m in peft_modules(model) for p in m.parameters()}
    heads = [m for m in (model.head, getattr(model, "rotation_head", None)) if m is not None]
    head = {id(p) for m in heads for p in m.parameters()}
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
