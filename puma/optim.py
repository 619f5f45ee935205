"""AdamW parameter groups, step decay and gradient clipping (DESIGN.md section 1, paper appendix A).

Learning rate of each group = ``optim.lr`` x its multiplier:

    backbone  x backbone_lr_mult  (1; only methods that train backbone weights put anything here)
    modules   x module_lr_mult    (10; adapters and prompts)
    head      x head_lr_mult      (default: module_lr_mult; the 128-d embedding layer)
    proxies   x proxy_lr_mult     (1e4; the loss's proxies, as Proxy-Anchor and the released code)

Every group uses ``optim.weight_decay`` (the released code decays every group, proxies included).
The rate halves (``gamma``) every ``step_epochs`` epochs; the scheduler is stepped once per epoch,
so epoch e trains at lr x gamma^(e // step_epochs). ``warmup_steps`` > 0 scales every group's rate by
min(1, (s + 1) / warmup_steps) at optimiser step s (counted over the whole run), on top of the
epoch schedule (:func:`set_step_lr`, called before each step). Gradients are clipped by value to
+-``clip_value`` (the released code clamps every model and loss gradient to +-1).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from puma.config import OptimConfig

MODEL_GROUPS = ("backbone", "modules", "head")


def group_lr_mults(cfg: OptimConfig) -> dict[str, float]:
    """Learning-rate multiplier of each named group."""
    head = cfg.module_lr_mult if cfg.head_lr_mult is None else cfg.head_lr_mult
    return {"backbone": cfg.backbone_lr_mult, "modules": cfg.module_lr_mult,
            "head": head, "proxies": cfg.proxy_lr_mult}


def build_optimizer(param_groups: Mapping[str, Iterable[nn.Parameter]], loss_module: nn.Module | None,
                    cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the model's named groups plus the loss's proxies; frozen and empty groups are left out.

    ``param_groups`` maps "backbone" / "modules" / "head" to parameters (missing keys are empty).
    Each optimiser group carries ``name`` and ``lr_mult`` so schedulers and logs can show it.
    """
    unknown = sorted(set(param_groups) - set(MODEL_GROUPS))
    if unknown:
        raise ValueError(f"unknown parameter group(s) {unknown}; valid: {list(MODEL_GROUPS)}")
    named = {name: list(param_groups.get(name, ())) for name in MODEL_GROUPS}
    named["proxies"] = _proxy_parameters(loss_module)
    _check_disjoint(named)
    mults, groups = group_lr_mults(cfg), []
    for name, params in named.items():
        trainable = [p for p in params if p.requires_grad]
        if trainable:
            groups.append({"name": name, "params": trainable, "lr": cfg.lr * mults[name],
                           "lr_mult": mults[name], "weight_decay": cfg.weight_decay})
    if not groups:
        raise ValueError("no trainable parameters: every group is empty or frozen "
                         f"(sizes: { {k: len(v) for k, v in named.items()} })")
    return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _proxy_parameters(loss_module: nn.Module | None) -> list[nn.Parameter]:
    """``loss_module.proxy_parameters()`` if it has one, else all its parameters; [] for None."""
    if loss_module is None:
        return []
    if hasattr(loss_module, "proxy_parameters"):
        return list(loss_module.proxy_parameters())
    return list(loss_module.parameters())


def _check_disjoint(named: dict[str, list[nn.Parameter]]) -> None:
    """Raise if one parameter is listed in two groups (or twice in one)."""
    seen: dict[int, str] = {}
    for name, params in named.items():
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"group {name!r} holds a {type(p).__name__}; expected nn.Parameter")
            if id(p) in seen:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is in group {seen[id(p)]!r} "
                                 f"and again in {name!r}; each parameter must be in exactly one group")
            seen[id(p)] = name


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.lr_scheduler.StepLR:
    """Step decay: every group's lr x gamma every ``step_epochs`` epochs (call ``.step()`` once per epoch)."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=cfg.step_epochs, gamma=cfg.gamma)


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warm-up: min(1, (step + 1) / warmup_steps) for the 0-based optimiser step; 1 without one."""
    return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)


def set_step_lr(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                step: int, warmup_steps: int) -> None:
    """Each group's lr = the epoch schedule's lr x the warm-up factor of ``step``.

    Call before every optimiser step, and :func:`end_warmup_epoch` before ``scheduler.step()`` so
    the (chainable) step schedule continues from its own rates, not the warmed-up ones.
    """
    factor = warmup_factor(step, warmup_steps)
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr * factor


def end_warmup_epoch(optimizer: torch.optim.Optimizer,
                     scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Restore the schedule's own rates (undo a partial warm-up factor) before ``scheduler.step()``."""
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr


def clip_gradients(parameters: Iterable[torch.Tensor], clip_value: float) -> None:
    """Clamp each existing gradient in place to +-clip_value; parameters without a gradient are skipped."""
    if not clip_value > 0:
        raise ValueError(f"clip_value={clip_value!r} must be > 0")
    torch.nn.utils.clip_grad_value_(list(parameters), clip_value)
