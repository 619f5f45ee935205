"""DDP and the gathered loss: two Ray Train workers equal one process on the same global batch."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import tiny_images, tiny_model_config, train_module_state

from puma.config import LossConfig, OptimConfig
from puma.losses import build_loss
from puma.methods import TrainModule, build_model
from puma.models.trainable import trainable_parameter_groups
from puma.optim import build_optimizer
from puma.train.step import train_step

GLOBAL_BATCH, STEPS, NUM_CLASSES = 8, 3, 4


def _module() -> tuple[TrainModule, torch.optim.Optimizer]:
    torch.manual_seed(0)
    cfg = tiny_model_config(adapter={"keep_prob": 1.0})  # no sampling: ranks must agree exactly
    model = build_model(cfg)
    loss = build_loss(LossConfig(), NUM_CLASSES, cfg.head.embed_dim)
    optimizer = build_optimizer(trainable_parameter_groups(model), loss, OptimConfig(lr=1e-3))
    return TrainModule(model, loss), optimizer


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.arange(GLOBAL_BATCH) % NUM_CLASSES
    return tiny_images(GLOBAL_BATCH, seed=step), labels


def _worker(config: dict) -> None:
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    module, optimizer = _module()
    ddp = ray.train.torch.prepare_model(module, parallel_strategy_kwargs={"broadcast_buffers": False})
    per = GLOBAL_BATCH // world
    for step in range(STEPS):
        images, labels = _global_batch(step)
        train_step(ddp, optimizer, images[rank * per:(rank + 1) * per], labels[rank * per:(rank + 1) * per],
                   clip_value=1.0)
    if rank == 0:
        save_file(train_module_state(module), config["out"])
    ray.train.report({"done": 1})


@pytest.mark.budget(150)  # two Ray Train fits, one and two workers (12-84 s)
def test_two_workers_match_one_process(ray_cluster, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = str(tmp_path / "two_workers.safetensors")
    TorchTrainer(_worker, train_loop_config={"out": out},
                 scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
                 run_config=RunConfig(name="ddp-equivalence", storage_path=str(tmp_path / "runs"))).fit()
    distributed = load_file(out)

    module, optimizer = _module()
    initial = train_module_state(module)
    for step in range(STEPS):
        images, labels = _global_batch(step)
        train_step(module, optimizer, images, labels, clip_value=1.0)
    single = train_module_state(module)

    assert set(distributed) == set(single)
    moved = [k for k in single if not torch.equal(single[k], initial[k])]
    assert len(moved) >= len(single) - 1, "training must move (almost) every trainable tensor"
    for key in single:
        torch.testing.assert_close(distributed[key], single[key], rtol=1e-4, atol=1e-5, msg=key)
