"""The training paths on a real CUDA device (run with ``pytest -m gpu`` on a GPU machine).

What a CPU cannot show: the same step on CUDA equals the CPU step in fp32; bf16 and fp16 autocast
steps (fp16 through the GradScaler) track fp32; two Ray Train workers sharing one GPU equal one
CUDA process; and jobs/train.py's worker loop on the GPU over NCCL (one worker per GPU: NCCL
refuses two ranks on one device) writes a checkpoint that reloads and verifies on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from tiny import TINY_BACKBONE, tiny_images, tiny_model_config, train_module_state

from puma.config import LossConfig, OptimConfig
from puma.losses import build_loss
from puma.methods import TrainModule, build_model
from puma.models.trainable import trainable_parameter_groups
from puma.optim import build_optimizer
from puma.train.step import train_step

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BATCH, CLASSES, STEPS = 8, 4, 3


@pytest.fixture(autouse=True)
def _no_tf32():
    """Full fp32 matrix products, so CUDA and CPU can agree to fp32 rounding."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _module(device: str, keep_prob: float = 1.0) -> tuple[TrainModule, torch.optim.Optimizer]:
    torch.manual_seed(0)
    cfg = tiny_model_config(adapter={"keep_prob": keep_prob})
    model = build_model(cfg)
    loss = build_loss(LossConfig(), CLASSES, cfg.head.embed_dim)
    module = TrainModule(model, loss).to(device)
    return module, build_optimizer(trainable_parameter_groups(model), loss, OptimConfig(lr=1e-3))


def _batch(step: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return tiny_images(BATCH, seed=step).to(device), (torch.arange(BATCH) % CLASSES).to(device)


def _train(device: str, precision: str = "fp32", steps: int = STEPS) -> tuple[TrainModule, list[float]]:
    module, optimizer = _module(device)
    # fp16: a first scale that does not overflow, so the one compared step is not skipped (at the
    # default 2**16 the scaler skips overflowing steps and halves the scale, as designed)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10) if precision == "fp16" else None
    losses = [train_step(module.train(), optimizer, *_batch(s, device), 1.0, precision, scaler)["loss"]
              for s in range(steps)]
    return module, losses


def test_a_step_on_cuda_equals_the_cpu_step_in_fp32():
    cpu, cpu_losses = _train("cpu")
    gpu, gpu_losses = _train("cuda")
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-4, abs=1e-5)
    expected = train_module_state(cpu)
    got = {k: v.cpu() for k, v in train_module_state(gpu).items()}
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_steps_track_the_fp32_step(precision):
    """One step from the same start: loss within 2%, every gradient within cosine 0.98 of fp32."""
    ref, ref_loss = _train("cuda", "fp32", steps=1)
    low, low_loss = _train("cuda", precision, steps=1)
    assert low_loss[0] == pytest.approx(ref_loss[0], rel=2e-2)
    pairs = [(n, p.grad, dict(low.named_parameters())[n].grad) for n, p in ref.named_parameters()
             if p.grad is not None and p.grad.abs().sum() > 0]
    names = " ".join(n for n, _, _ in pairs)
    assert all(part in names for part in ("adapter", "prompt_pool", "head", "loss.")), names
    for name, g_ref, g_low in pairs:
        assert g_low is not None and torch.isfinite(g_low).all(), name
        cos = torch.nn.functional.cosine_similarity(g_ref.flatten().float(), g_low.flatten().float(), dim=0)
        assert cos > 0.98, f"{name}: cosine {cos:.4f} to the fp32 gradient"


def _ray_worker(config: dict) -> None:
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    module, optimizer = _module(str(device))
    ddp = ray.train.torch.prepare_model(module, parallel_strategy_kwargs={"broadcast_buffers": False})
    per = BATCH // world
    for step in range(STEPS):
        images, labels = _batch(step, str(device))
        train_step(ddp, optimizer, images[rank * per:(rank + 1) * per], labels[rank * per:(rank + 1) * per],
                   clip_value=1.0)
    if rank == 0:
        save_file({k: v.cpu() for k, v in train_module_state(module).items()}, config["out"])
    ray.train.report({"done": 1})


def test_two_ray_train_workers_sharing_the_gpu_equal_one_cuda_process(ray_cluster, tmp_path):
    """Gradients of the gathered global batch, across two processes on one device (gloo on CUDA)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if ray_cluster.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("no GPU in this Ray cluster")
    out = str(tmp_path / "two_workers.safetensors")
    TorchTrainer(_ray_worker, train_loop_config={"out": out}, torch_config=TorchConfig(backend="gloo"),
                 scaling_config=ScalingConfig(num_workers=2, use_gpu=True,
                                              resources_per_worker={"CPU": 0.5, "GPU": 0.5}),
                 run_config=RunConfig(name="gpu-ddp", storage_path=str(tmp_path / "runs"))).fit()
    single, _ = _train("cuda")
    expected = {k: v.cpu() for k, v in train_module_state(single).items()}
    got = load_file(out)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("decode_on", ["tasks", "worker"])
def test_the_training_job_runs_on_the_gpu_over_nccl_and_its_checkpoint_loads_on_cpu(
        ray_cluster, cub_tree, tmp_path, decode_on):
    """data.decode_on=worker: the Train worker decodes the JPEGs with nvjpeg (training and evaluation)."""
    from puma.checkpoint import load_model, read_checkpoint
    from puma.config import load_config
    from puma.data.prepare import prepare
    from puma.data.sources import SourceSpec
    from puma.train.driver import run_training

    if ray_cluster.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("no GPU in this Ray cluster")
    cub_tree(tmp_path / "cub", num_classes=4, per_class=8)
    data = str(tmp_path / "prepared")
    prepare([SourceSpec("cub", "cub", str(tmp_path / "cub"))], data, log=lambda _: None)
    cfg_file = tmp_path / "gpu.yaml"
    cfg_file.write_text(yaml.safe_dump({
        "model": {"backbone": dict(TINY_BACKBONE), "adapter": {"rank": 8},
                  "prompt_pool": {"pool_size": 4, "length": 2}, "head": {"embed_dim": 16}},
        "data": {"uri": data, "preset": "", "decode_batch_size": 8,
                 "decode_on": decode_on},
        "train": {"epochs": 2, "batch_size": 8, "cpus_per_worker": 0.5, "use_gpu": True,
                  "gpus_per_worker": 1.0, "precision": "bf16", "storage_path": str(tmp_path / "runs"),
                  "run_name": "gpu"},
        "eval": {"batch_size": 32}}))
    outcome = run_training(load_config(cfg_file))
    assert outcome.metrics["epoch"] == 2
    history = read_checkpoint(outcome.last_checkpoint).meta["run_state"]["history"]
    assert [h["epoch"] for h in history] == [1, 2] and all(h["train/loss"] > 0 for h in history)
    model, _ = load_model(outcome.last_checkpoint)  # on the CPU; verifies the probe embeddings
    assert all(p.device.type == "cpu" for p in model.parameters())
