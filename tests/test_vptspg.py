"""VPTSP-G (ICLR 2024): trainable set, training, equations, the class-prompt memory bank, checkpoints, DDP."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_train_job import tiny_data  # noqa: F401 (fixture)
from tiny import tiny_images, tiny_model_config, train_module_state

from puma.checkpoint import CheckpointState, load_model, probe_embeddings, read_checkpoint, save_checkpoint
from puma.config import Config, ConfigError, LossConfig, OptimConfig, VptspgConfig
from puma.losses.memory_bank import ClassPromptBank
from puma.losses.semantic_proxy import fuse_batch, proxy_anchor_loss
from puma.methods import build_model, build_train_module, load_config  # load_config: with the method's checks
from puma.methods.vptsp_g import VptspgTrainModule
from puma.models import count_trainable, trainable_parameter_groups, trainable_state_dict
from puma.models.vptspg import SemanticProxyGRU, VptspgModel, ema_fuse
from puma.optim import build_optimizer
from puma.train.step import train_step

REPO = Path(__file__).resolve().parent.parent
NUM_CLASSES, E = 8, 16
SMALL = {"prompt_length": 3, "class_prompt_layers": 2, "class_prompt_length": 2}
OPTIM = OptimConfig(lr=1e-3, proxy_lr_mult=10.0, weight_decay=0.05)


def vptspg_config(**options) -> Config:
    """A Config with the tiny VPTSP-G model and the Proxy-Anchor loss."""
    model = tiny_model_config(method="vptsp_g", vptsp_g={**SMALL, **options})
    return dataclasses.replace(Config(), model=model, loss=LossConfig(name="proxy_anchor"))


def build(cfg: Config, seed: int = 0) -> tuple[VptspgTrainModule, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    module = build_train_module(cfg, build_model(cfg.model), NUM_CLASSES)
    optimizer = build_optimizer(trainable_parameter_groups(module.model), module.loss, OPTIM)
    return module.train(), optimizer


def batch(step: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Batches over different class subsets: step s uses classes {s, s+1, s+2} mod 8 (+ repeats)."""
    labels = (torch.arange(size) % 3 + step) % NUM_CLASSES
    return tiny_images(size, seed=step), labels


def is_head(n: str) -> bool:
    return n.startswith("head.")


def expected_trainable(name: str, bitfit: bool, gru: bool = True) -> bool:
    return (is_head(name) or name.startswith(("visual_prompts.", "proxy_head."))
            or (gru and name.startswith("fusion."))
            or (bitfit and name.startswith("backbone.") and name.endswith(".bias")))


# ----------------------------------------------------------------------------- config and trainability


def test_config_errors_name_the_key_and_what_is_valid():
    with pytest.raises(ConfigError, match=r"model.vptsp_g.fusion='lstm'.*\['gru', 'ema'\]"):
        VptspgConfig(fusion="lstm")
    with pytest.raises(ConfigError, match=r"model.vptsp_g.proxy_bias_ratio=1.5 is out of range"):
        VptspgConfig(proxy_bias_ratio=1.5)
    with pytest.raises(ConfigError, match="set loss.name=proxy_anchor"):
        load_config(None, ["model.method=vptsp_g"])
    with pytest.raises(ConfigError, match="class_prompt_layers=3 must be between 1 and the backbone depth 2"):
        build_model(vptspg_config(class_prompt_layers=3).model)


@pytest.mark.parametrize("bitfit", [False, True])
@pytest.mark.parametrize("fusion", ["gru", "ema"])
def test_trainable_set_is_exactly_the_declared_parts(bitfit, fusion):
    model = build_model(vptspg_config(bitfit=bitfit, fusion=fusion).model)
    names = [n for n, _ in model.named_parameters()]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n in names if expected_trainable(n, bitfit, fusion == "gru")}
    groups = trainable_parameter_groups(model)
    assert bool(groups["backbone"]) == bitfit  # BitFit's biases train in the backbone group
    modules = ("visual_prompts.", "proxy_head.", "fusion.")
    assert {id(p) for p in groups["modules"]} == {id(p) for n, p in model.named_parameters()
                                                   if n.startswith(modules)}


def test_bitfit_adds_exactly_the_backbone_biases():
    plain = build_model(vptspg_config(bitfit=False).model)
    bitfit = build_model(vptspg_config(bitfit=True).model)
    added = ({n for n, p in bitfit.named_parameters() if p.requires_grad}
             - {n for n, p in plain.named_parameters() if p.requires_grad})
    biases = {n for n, _ in bitfit.backbone.named_parameters() if n.endswith("bias")}
    assert added == {f"backbone.{n}" for n in biases} and len(added) == 14  # 6 per block x 2 + patch + norm


def test_paper_config_counts_the_papers_trainable_parameters():
    """configs/methods/vptsp_g.yaml on ViT-S/16, CUB's 100 classes: 1.55M (paper Table 1: 1.56M)."""
    cfg = load_config(REPO / "configs" / "methods" / "vptsp_g.yaml", ["model.backbone.weights=none"])
    module = build_train_module(cfg, build_model(cfg.model), 100)
    bank = module.loss.class_prompts
    assert bank.table.shape == (100, 6, 1, 384)
    total = count_trainable(module.model) + module.loss.proxies.numel() + bank.table.numel()
    assert abs(total - 1.56e6) < 0.02e6, total


# ----------------------------------------------------------------------------- training


def test_training_steps_fall_and_gradients_reach_exactly_the_trainable_set():
    module, optimizer = build(vptspg_config(bitfit=True))
    model, bank = module.model, module.loss.class_prompts
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    table0 = bank.table.clone()
    images, labels = batch(0)
    losses = [train_step(module, optimizer, images, labels, clip_value=1.0)["loss"] for _ in range(8)]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.8 * losses[0], losses
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
            assert not torch.equal(p.detach(), before[name]), name
        else:
            assert p.grad is None and torch.equal(p.detach(), before[name]), name
    present = torch.unique(labels)
    absent = torch.tensor([c for c in range(NUM_CLASSES) if c not in present.tolist()])
    assert (bank.table[present] != table0[present]).flatten(1).any(1).all()  # the batch's prompts train
    assert torch.equal(bank.table[absent], table0[absent])  # the others are untouched
    assert torch.equal(bank.steps, torch.isin(torch.arange(NUM_CLASSES), present).long() * 8)


def test_image_path_is_the_embedding_and_ignores_class_prompts():
    module, _ = build(vptspg_config())
    model = module.model.eval()
    x = tiny_images(3)
    with torch.no_grad():
        emb = model(x)
        assert torch.equal(emb, model.head(model.encode(x)))
        assert torch.allclose(emb.norm(dim=-1), torch.ones(3))
        prompts = torch.randn(3, *model.class_prompt_shape)
        proxies = model.semantic_proxies(x, prompts)
        assert not torch.allclose(model.proxy_head(model.encode(x)), proxies)  # class prompts matter
        assert torch.equal(model(x), emb)  # and never leak into the image path


# ----------------------------------------------------------------------------- equations


def test_proxy_anchor_equals_pytorch_metric_learning():
    from pytorch_metric_learning.losses import ProxyAnchorLoss

    gen = torch.Generator().manual_seed(0)
    emb = F.normalize(torch.randn(10, E, generator=gen), dim=-1)
    proxies = F.normalize(torch.randn(NUM_CLASSES, E, generator=gen), dim=-1)
    labels = torch.tensor([0, 0, 1, 2, 2, 2, 5, 5, 7, 1])  # classes 3, 4, 6 have no positives
    pml = ProxyAnchorLoss(NUM_CLASSES, E, margin=0.1, alpha=32)
    pml.proxies.data.copy_(proxies)
    torch.testing.assert_close(proxy_anchor_loss(emb, proxies, labels), pml(emb, labels),
                               rtol=1e-5, atol=1e-5)


def test_gru_follows_equations_4_to_7():
    torch.manual_seed(0)
    gru = SemanticProxyGRU(E, "relu")
    p, h = torch.randn(3, E), F.normalize(torch.randn(3, E), dim=-1)
    (wz, wr, wh), (bz, br, bh) = gru.w.weight.chunk(3), gru.w.bias.chunk(3)
    uz, ur, uh = gru.u.weight.chunk(3)
    z = torch.sigmoid(p @ wz.T + h @ uz.T + bz)
    r = torch.sigmoid(p @ wr.T + h @ ur.T + br)
    n = torch.relu(p @ wh.T + r * (h @ uh.T) + bh)
    torch.testing.assert_close(gru(p, h), F.normalize((1 - z) * h + z * n, dim=-1))
    assert sum(t.numel() for t in gru.parameters()) == 3 * (2 * E * E + E)
    torch.testing.assert_close(ema_fuse(p, h, 0.25), F.normalize(h + 0.75 * p, dim=-1))  # Eq. 3


def test_fusion_feeds_each_class_in_order_and_keeps_gradient_inside_the_batch():
    proxies = torch.randn(6, 4, requires_grad=True)
    labels = torch.tensor([3, 1, 3, 3, 1, 0])
    memory = torch.randn(5, 4)
    order: list[int] = []

    def fuse(p, h):  # non-commutative: each class's result depends on its feeding order
        order.append(p.shape[0])
        return 0.5 * h + p

    classes, fused = fuse_batch(proxies, labels, memory, fuse, torch.Generator().manual_seed(1))
    assert classes.tolist() == [0, 1, 3] and order == [3, 2, 1]  # step i fuses every class's i-th sample
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(1))
    for k, c in enumerate(classes.tolist()):
        expect = memory[c]
        for i in perm.tolist():
            if labels[i] == c:
                expect = 0.5 * expect + proxies[i]
        torch.testing.assert_close(fused[k], expect)
    fused.sum().backward()
    assert proxies.grad is not None and proxies.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- the memory bank


class ResidentPrompts:
    """Reference: every class's prompts resident as its own parameter, trained by torch.optim.AdamW.

    Only the batch's classes get a gradient (the others' .grad stays None, so AdamW skips them).
    """

    def __init__(self, table: torch.Tensor) -> None:
        self.params = [torch.nn.Parameter(row.clone()) for row in table]
        self.optimizer = torch.optim.AdamW(self.params, lr=1.0)
        self.gathered: list[int] = []

    def gather(self, classes: torch.Tensor) -> torch.Tensor:
        self.gathered = classes.tolist()
        return torch.stack([self.params[c] for c in self.gathered])

    def step(self, lr, weight_decay, betas, eps, clip_value, grad_scale) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.clamp_(-clip_value, clip_value)
        self.optimizer.param_groups[0].update(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def table(self) -> torch.Tensor:
        return torch.stack([p.detach() for p in self.params])


def test_bank_update_equals_adamw_over_resident_per_class_parameters():
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(6, 2, 3, generator=gen)
    bank, resident = ClassPromptBank(table), ResidentPrompts(table)
    for _ in range(6):
        classes = torch.unique(torch.randint(0, 6, (3,), generator=gen))
        target = torch.randn(len(classes), 2, 3, generator=gen)
        untouched = bank.table.clone()
        for store in (bank, resident):
            ((store.gather(classes) - target) ** 2).sum().backward()
            store.step(lr=0.05, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8, clip_value=1.0,
                       grad_scale=1.0)
        absent = [c for c in range(6) if c not in classes.tolist()]
        assert torch.equal(bank.table[absent], untouched[absent])  # rows without gradient: bit-identical
        torch.testing.assert_close(bank.table, resident.table, rtol=0, atol=1e-6)
    assert bank.rows_moved == int(bank.steps.sum())


class RecordingBank(ClassPromptBank):
    """The real bank, recording the rows and the device of every gathered leaf."""

    def __init__(self, table: torch.Tensor, offload: bool = True) -> None:
        super().__init__(table, offload)
        self.record: list[tuple[list[int], tuple[int, ...], str]] = []

    def gather(self, classes: torch.Tensor) -> torch.Tensor:
        leaf = super().gather(classes)
        self.record.append((self.rows.tolist(), tuple(leaf.shape), leaf.device.type))
        return leaf


def train_with(store_factory, steps: int = 4, device: str = "cpu") -> tuple[dict[str, torch.Tensor], object]:
    """Train VPTSP-G ``steps`` steps with the class prompts held by ``store_factory(table)``."""
    module, optimizer = build(vptspg_config(bitfit=True))
    bank = module.loss.class_prompts
    module.to(device)
    module.loss.class_prompts = store = store_factory(bank.table.to(device))
    for step in range(steps):
        images, labels = batch(step)
        train_step(module, optimizer, images.to(device), labels.to(device), clip_value=1.0)
    state = {f"model.{k}": v.detach().cpu() for k, v in trainable_state_dict(module.model).items()}
    state.update({"loss.proxies": module.loss.proxies.detach().cpu(), "loss.memory": module.loss.memory.cpu(),
                  "class_prompts": store.table.detach().cpu()})
    return state, store


def assert_states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


def test_memory_bank_moves_only_the_batch_prompts_and_equals_all_prompts_resident():
    banked, bank = train_with(RecordingBank)
    resident, _ = train_with(ResidentPrompts)
    on_device, _ = train_with(lambda t: ClassPromptBank(t, offload=False))
    initial, _ = train_with(ResidentPrompts, steps=0)
    for step, (rows, shape, _) in enumerate(bank.record):
        expected = torch.unique(batch(step)[1]).tolist()
        assert rows == expected and shape[0] == len(expected) == 3  # K = 3 of the 8 classes
    assert bank.rows_moved == 4 * 3 and bank.storage_device.type == "cpu"
    assert_states_equal(banked, resident)
    assert_states_equal(banked, on_device)
    assert all(not torch.equal(banked[k], initial[k]) for k in banked), "every tensor must have trained"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_memory_bank_on_gpu_keeps_the_table_on_cpu_and_equals_resident():
    banked, bank = train_with(RecordingBank, device="cuda")
    resident, _ = train_with(ResidentPrompts, device="cuda")
    assert {dev for _, _, dev in bank.record} == {"cuda"} and bank.table.device.type == "cpu"
    assert bank.exp_avg.device.type == "cpu"
    # The key third of each qkv bias (BitFit) has a true gradient of zero (softmax ignores a shift
    # shared by every key): its rounding noise (~1e-8) differs between the two CUDA code paths, and
    # Adam turns noise into steps of up to lr. Compare it by that bound, everything else exactly.
    for state in (banked, resident):
        for key in [k for k in state if k.endswith("attn.qkv.bias")]:
            d = state[key].shape[0] // 3
            state[key + ".key_third"] = state[key][d:2 * d]
            state[key] = torch.cat([state[key][:d], state[key][2 * d:]])
    keys = [k for k in banked if k.endswith(".key_third")]
    max_lr = max(g["lr"] for g in build(vptspg_config(bitfit=True))[1].param_groups)
    bound = 2 * 4 * 3 * max_lr  # two runs, 4 steps, an Adam step of at most ~3 lr on noise
    assert keys and all((banked[k] - resident[k]).abs().max() <= bound for k in keys)
    assert_states_equal({k: v for k, v in banked.items() if k not in keys},
                        {k: v for k, v in resident.items() if k not in keys}, atol=1e-5)


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip_embeds_the_same_and_restores_the_bank(tmp_path):
    cfg = vptspg_config(bitfit=True)
    module, optimizer = build(cfg)
    for step in range(2):
        train_step(module, optimizer, *batch(step), clip_value=1.0)
    uri = str(tmp_path / "ckpt")
    save_checkpoint(uri, CheckpointState(config=cfg, model=trainable_state_dict(module.model),
                                         loss=module.loss.state_dict(), optimizer=optimizer.state_dict(),
                                         meta={"probe": probe_embeddings(module.model, 32)}))
    model, loaded_cfg = load_model(uri)  # verifies the probe embeddings too
    assert isinstance(model, VptspgModel) and loaded_cfg.model.method == "vptsp_g"
    x = tiny_images(5, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(model(x), module.model.eval()(x), rtol=0, atol=1e-6)
    ckpt = read_checkpoint(uri, with_optimizer=True)
    fresh, _ = build(cfg, seed=1)
    fresh.loss.load_state_dict(ckpt.loss)  # strict: the bank keys are consumed by the bank
    old, new = module.loss.class_prompts, fresh.loss.class_prompts
    for key in ("table", "exp_avg", "exp_avg_sq", "steps"):
        assert torch.equal(getattr(old, key), getattr(new, key)), key
    assert torch.equal(fresh.loss.memory, module.loss.memory)
    saved = load_file(str(tmp_path / "ckpt" / "loss.safetensors"))
    assert saved["class_prompts.table"].shape == (8, 2, 2, 48)  # (C, CLS-L, m, D)


def test_resume_from_a_checkpoint_continues_exactly(tmp_path):
    """2 steps, save, load into a fresh module and optimiser, 2 steps == 4 steps without a break."""
    cfg = vptspg_config(bitfit=True)
    straight, opt = build(cfg)
    for step in range(4):
        train_step(straight, opt, *batch(step), clip_value=1.0)
    first, opt = build(cfg)
    for step in range(2):
        train_step(first, opt, *batch(step), clip_value=1.0)
    uri = save_checkpoint(str(tmp_path / "ckpt"), CheckpointState(
        config=cfg, model=trainable_state_dict(first.model), loss=first.loss.state_dict(),
        optimizer=opt.state_dict()))
    ckpt = read_checkpoint(uri, with_optimizer=True)
    resumed, opt = build(cfg, seed=1)
    resumed.model.load_state_dict(ckpt.model, strict=False)
    resumed.loss.load_state_dict(ckpt.loss)
    opt.load_state_dict(ckpt.optimizer)
    for step in range(2, 4):
        train_step(resumed, opt, *batch(step), clip_value=1.0)
    assert_states_equal(train_module_state(resumed), train_module_state(straight), atol=0)


def test_bank_refuses_a_table_of_another_shape():
    bank = ClassPromptBank(torch.zeros(4, 2, 1, 8))
    with pytest.raises(ValueError, match=r"does not fit this bank \(4, 2, 1, 8\)"):
        bank.load_state_dict(ClassPromptBank(torch.zeros(5, 2, 1, 8)).state_dict())
    with pytest.raises(ValueError, match=r"class ids must be in \[0, 4\)"):
        bank.gather(torch.tensor([1, 4]))


# ----------------------------------------------------------------------------- DDP

GLOBAL_BATCH, DDP_STEPS = 8, 3


def _ddp_worker(config: dict) -> None:
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    module, optimizer = build(vptspg_config(bitfit=True))
    ddp = ray.train.torch.prepare_model(module, parallel_strategy_kwargs={"broadcast_buffers": False})
    per = GLOBAL_BATCH // world
    for step in range(DDP_STEPS):
        images, labels = batch(step, GLOBAL_BATCH)
        labels = labels.roll(rank)  # ranks see different classes: their gathered rows must still agree
        train_step(ddp, optimizer, images[rank * per:(rank + 1) * per], labels[rank * per:(rank + 1) * per],
                   clip_value=1.0)
    save_file(train_module_state(module), config["out"].format(rank=rank))
    ray.train.report({"done": 1})


def test_two_workers_match_one_process(ray_cluster, tmp_path):
    """Two DDP workers (each its own bank replica, rows all-reduced) equal one process on the global batch."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = str(tmp_path / "rank{rank}.safetensors")
    TorchTrainer(_ddp_worker, train_loop_config={"out": out},
                 scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
                 run_config=RunConfig(name="vptspg-ddp", storage_path=str(tmp_path / "runs"))).fit()
    ranks = [load_file(out.format(rank=r)) for r in range(2)]
    module, optimizer = build(vptspg_config(bitfit=True))
    for step in range(DDP_STEPS):
        images, labels = batch(step, GLOBAL_BATCH)
        labels = torch.cat([labels.roll(0)[:4], labels.roll(1)[4:]])  # the ranks' slices, in rank order
        train_step(module, optimizer, images, labels, clip_value=1.0)
    single = train_module_state(module)
    for key in single:
        torch.testing.assert_close(ranks[0][key], ranks[1][key], rtol=0, atol=0, msg=key)  # replicas agree
        torch.testing.assert_close(without_key_bias(key, ranks[0][key]), without_key_bias(key, single[key]),
                                   rtol=1e-4, atol=1e-5, msg=key)


def without_key_bias(key: str, value: torch.Tensor) -> torch.Tensor:
    """qkv.bias without its key third: softmax ignores a key bias, so its gradient is float noise that
    AdamW's first steps turn into +-lr moves (different noise in one process and in two)."""
    if not key.endswith("attn.qkv.bias"):
        return value
    q, _, v = value.chunk(3)
    return torch.cat([q, v])


def test_other_methods_keep_the_plain_train_module():
    from puma.losses.factory import MetricLoss
    from puma.methods import TrainModule

    cfg = dataclasses.replace(Config(), model=tiny_model_config())
    module = build_train_module(cfg, build_model(cfg.model), NUM_CLASSES)
    assert type(module) is TrainModule and isinstance(module.loss, MetricLoss)


# ----------------------------------------------------------------------------- the training job


def test_training_job_fits_and_its_checkpoint_embeds(ray_cluster, tiny_data, tmp_path):  # noqa: F811
    """run_training (Ray Train, real images) with model.method=vptsp_g: 1 epoch of 2 steps, then reload."""
    import yaml
    from test_train_job import tiny_config as job_config

    from puma.train.driver import run_training

    path = job_config(tmp_path / "tiny.yaml", tiny_data, str(tmp_path / "runs"), epochs=1)
    data = yaml.safe_load(path.read_text())
    data["model"].update(method="vptsp_g", vptsp_g=SMALL)
    data["loss"] = {"name": "proxy_anchor"}
    data["train"]["max_steps_per_epoch"] = 2
    path.write_text(yaml.safe_dump(data))
    outcome = run_training(load_config(path))
    assert outcome.metrics["train/steps"] == 2 and math.isfinite(outcome.metrics["train/loss"])
    model, _ = load_model(outcome.last_checkpoint)  # verifies the probe embeddings
    assert isinstance(model, VptspgModel)
    bank = read_checkpoint(outcome.last_checkpoint).loss
    assert int(bank["class_prompts.steps"].sum()) > 0  # the batch's classes were trained
    assert bank["class_prompts.table"].shape == (3, 2, 2, 48)  # 3 training classes
