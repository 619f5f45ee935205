"""Optimiser groups (lr multipliers, weight decay), step decay and clipping by value."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from puma.config import LossConfig, OptimConfig
from puma.losses import build_loss
from puma.optim import (
    build_optimizer,
    build_scheduler,
    clip_gradients,
    end_warmup_epoch,
    set_step_lr,
    warmup_factor,
)


class ToyModel(nn.Module):
    """Names mimic PumaModel: a frozen backbone, adapters and a prompt pool, an embedding head."""

    def __init__(self, train_backbone: bool = False):
        super().__init__()
        self.backbone = nn.Linear(8, 8)
        self.backbone.requires_grad_(train_backbone)
        self.adapter = nn.Linear(8, 8, bias=False)
        self.prompt_pool = nn.Parameter(torch.randn(3, 8))
        self.head = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.backbone(x) + self.adapter(x) + self.prompt_pool.mean(0)  # (B, 8)
        return nn.functional.normalize(self.head(h), dim=1)  # (B, 16)

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        return {"backbone": list(self.backbone.parameters()),
                "modules": [*self.adapter.parameters(), self.prompt_pool],
                "head": list(self.head.parameters())}


def by_name(optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    return {g["name"]: g for g in optimizer.param_groups}


def test_groups_have_base_x10_and_x1e4_rates_and_weight_decay():
    model, loss = ToyModel(), build_loss(LossConfig(), num_classes=5, embed_dim=16)
    opt = build_optimizer(model.param_groups(), loss, OptimConfig())
    groups = by_name(opt)
    assert list(groups) == ["modules", "head", "proxies"]  # frozen backbone: no group
    assert groups["modules"]["lr"] == pytest.approx(1e-3) and groups["head"]["lr"] == pytest.approx(1e-3)
    assert groups["proxies"]["lr"] == pytest.approx(1.0)
    assert all(g["weight_decay"] == 1e-4 for g in opt.param_groups)
    assert [p is loss.loss.W for p in groups["proxies"]["params"]] == [True]
    assert len(groups["modules"]["params"]) == 2 and len(groups["head"]["params"]) == 2


def test_trainable_backbone_gets_base_rate_times_its_multiplier():
    model, loss = ToyModel(train_backbone=True), build_loss(LossConfig(name="triplet"), 5, 16)
    groups = by_name(build_optimizer(model.param_groups(), loss, OptimConfig(lr=2e-4)))
    assert list(groups) == ["backbone", "modules", "head"]  # pair loss: no proxies group
    assert groups["backbone"]["lr"] == pytest.approx(2e-4) and groups["head"]["lr"] == pytest.approx(2e-3)
    groups = by_name(build_optimizer(model.param_groups(), None, OptimConfig(backbone_lr_mult=0.1)))
    assert groups["backbone"]["lr"] == pytest.approx(1e-5) and groups["backbone"]["lr_mult"] == 0.1


def test_empty_and_missing_groups_are_skipped_and_bad_groups_raise():
    model = ToyModel()
    opt = build_optimizer({"head": list(model.head.parameters()), "backbone": []}, None, OptimConfig())
    assert [g["name"] for g in opt.param_groups] == ["head"]
    with pytest.raises(ValueError, match=r"unknown parameter group\(s\) \['adapters'\]"):
        build_optimizer({"adapters": [model.prompt_pool]}, None, OptimConfig())
    with pytest.raises(ValueError, match="in group 'modules' and again in 'head'"):
        build_optimizer({"modules": [model.prompt_pool], "head": [model.prompt_pool]}, None, OptimConfig())
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer({"backbone": list(model.backbone.parameters())}, None, OptimConfig())


def test_a_step_moves_trainable_parameters_and_leaves_the_frozen_backbone_bit_identical():
    torch.manual_seed(0)
    model, loss = ToyModel(), build_loss(LossConfig(), 5, 16)
    opt = build_optimizer(model.param_groups(), loss, OptimConfig())
    before = {k: v.clone() for k, v in {**model.state_dict(), **loss.state_dict()}.items()}
    value = loss(model(torch.randn(10, 8)), torch.arange(5).repeat(2))
    value.backward()
    clip_gradients([p for g in opt.param_groups for p in g["params"]], 1.0)
    opt.step()
    after = {**model.state_dict(), **loss.state_dict()}
    for key in ("backbone.weight", "backbone.bias"):
        assert torch.equal(after[key], before[key])
    for key in ("adapter.weight", "prompt_pool", "head.weight", "head.bias", "loss.W"):
        assert not torch.equal(after[key], before[key]), key


def test_scheduler_halves_every_group_at_epochs_20_and_40():
    model, loss = ToyModel(), build_loss(LossConfig(), 5, 16)
    opt = build_optimizer(model.param_groups(), loss, OptimConfig())
    sched = build_scheduler(opt, OptimConfig())
    lrs = []  # lrs[e]: {group: lr} used during epoch e
    for _ in range(60):
        lrs.append({g["name"]: g["lr"] for g in opt.param_groups})
        opt.step()  # (no gradients: a no-op, keeps the scheduler's call-order check quiet)
        sched.step()
    for name, base in (("modules", 1e-3), ("head", 1e-3), ("proxies", 1.0)):
        assert [lrs[e][name] for e in (0, 19)] == pytest.approx([base, base])
        assert [lrs[e][name] for e in (20, 39)] == pytest.approx([base / 2, base / 2])
        assert [lrs[e][name] for e in (40, 59)] == pytest.approx([base / 4, base / 4])
    json.dumps(opt.state_dict()["param_groups"])  # checkpoints keep the group layout as JSON


def test_clip_gradients_clamps_by_value():
    a, b, c = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))
    a.grad = torch.tensor([-5.0, 0.5, 3.0, -0.2])
    b.grad = torch.tensor([1.0, -1.0])
    clip_gradients([a, b, c], 1.0)  # c has no gradient: skipped
    assert a.grad.tolist() == pytest.approx([-1.0, 0.5, 1.0, -0.2])
    assert b.grad.tolist() == [1.0, -1.0] and c.grad is None
    clip_gradients([a], 0.25)
    assert a.grad.tolist() == pytest.approx([-0.25, 0.25, 0.25, -0.2])
    with pytest.raises(ValueError, match="clip_value=0"):
        clip_gradients([a], 0)


def test_head_lr_mult_defaults_to_the_module_rate_and_can_be_set_apart():
    model, loss = ToyModel(), build_loss(LossConfig(), num_classes=5, embed_dim=16)
    same = by_name(build_optimizer(model.param_groups(), loss, OptimConfig(lr=1e-4)))
    assert same["head"]["lr"] == pytest.approx(same["modules"]["lr"])
    apart = by_name(build_optimizer(model.param_groups(), loss, OptimConfig(lr=1e-4, head_lr_mult=50)))
    assert apart["head"]["lr"] == pytest.approx(5e-3) and apart["modules"]["lr"] == pytest.approx(1e-3)


def test_warmup_ramps_every_group_linearly_then_hands_back_to_the_epoch_schedule():
    model, loss = ToyModel(), build_loss(LossConfig(), num_classes=5, embed_dim=16)
    cfg = OptimConfig(lr=1e-4, warmup_steps=4, step_epochs=1, gamma=0.5)
    optimizer = build_optimizer(model.param_groups(), loss, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    base = {g["name"]: g["lr"] for g in optimizer.param_groups}
    seen = []
    for step in range(3):  # epoch 0: steps 0..2 at 1/4, 2/4, 3/4 of the rate
        set_step_lr(optimizer, scheduler, step, cfg.warmup_steps)
        seen.append({g["name"]: g["lr"] / base[g["name"]] for g in optimizer.param_groups})
    assert [s["modules"] for s in seen] == pytest.approx([0.25, 0.5, 0.75])
    assert all(len(set(round(v, 12) for v in s.values())) == 1 for s in seen)  # every group alike
    end_warmup_epoch(optimizer, scheduler)
    scheduler.step()  # epoch 1: the decay applies to the schedule's own rate, not the warmed-up one
    for step, factor in ((3, 1.0), (4, 1.0)):
        set_step_lr(optimizer, scheduler, step, cfg.warmup_steps)
        assert by_name(optimizer)["proxies"]["lr"] == pytest.approx(base["proxies"] * 0.5 * factor)
    assert warmup_factor(0, 0) == 1.0 and warmup_factor(9, 10) == 1.0
    with pytest.raises(Exception, match="warmup_steps"):
        OptimConfig(warmup_steps=-1)


@pytest.mark.parametrize("key", ["module_lr_mult", "proxy_lr_mult", "backbone_lr_mult", "head_lr_mult"])
def test_a_learning_rate_multiplier_that_is_not_positive_is_refused_when_the_config_loads(key):
    from puma.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=f"optim.{key}=-1.0 must be > 0"):  # AdamW would take it silently
        load_config(None, [f"optim.{key}=-1"])
