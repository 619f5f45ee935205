"""Baselines (PUMA Table 2(c), appendix B.4) and the extra losses (Tables 2, 5, 8): trainable sets,
training steps through the real TrainModule / train_step, LoRA, VPT, MLP-3, and hand computations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tiny import assert_eval_deterministic_train_stochastic, tiny_images, tiny_model_config

from puma.config import Config, ConfigError, LossConfig, OptimConfig
from puma.losses import LossInputError, build_loss
from puma.losses.xbm import CrossBatchMemoryLoss
from puma.methods import (
    METHOD_TRAINABLE,
    METHODS,
    TrainModule,
    build_method_training,
    build_model,
    mark_trainable,
)
from puma.models import (
    LoraBranch,
    MlpEmbeddingHead,
    StochasticAdapter,
    count_trainable,
    trainable_parameter_groups,
)
from puma.models.vpt import VptModel
from puma.optim import build_optimizer
from puma.train.step import train_step

D, E, DEPTH = 48, 16, 2  # tiny backbone width, embedding size, blocks


def method_config(method: str, **sections):
    """Tiny config for ``method``: small LoRA and VPT so every part is quick."""
    return tiny_model_config(method=method, lora={"rank": 4, **sections.pop("lora", {})},
                             vpt={"length": 3}, **sections)


def is_head(n: str) -> bool:
    return n.startswith("head.")


EXPECTED_TRAINABLE: dict[str, Callable[[str], bool]] = {
    "puma": lambda n: is_head(n) or ".adapter_" in n or n.startswith("prompt_pool."),
    "linear": is_head,
    "mlp3": is_head,
    "vpt_shallow": lambda n: is_head(n) or n.startswith("visual_prompts."),
    "vpt_deep": lambda n: is_head(n) or n.startswith("visual_prompts."),
    "lora": lambda n: is_head(n) or ".lora." in n,
    "puma_lora": lambda n: is_head(n) or ".adapter_" in n or ".lora." in n or n.startswith("prompt_pool."),
    "adaptformer": lambda n: is_head(n) or ".adapter_" in n,
    "bitfit": lambda n: is_head(n) or (n.startswith("backbone.") and n.endswith(".bias")),
    "full_finetune": lambda n: True,
    "udml_ss": lambda n: (is_head(n) or ".adapter_" in n or n.startswith("prompt_pool.")
                          or n.startswith("rotation_head.")),
}


def test_every_method_declares_its_trainable_set():
    # vptsp_g trains through its own TrainModule: tests/test_vptspg.py
    assert set(METHODS) == set(METHOD_TRAINABLE) == set(EXPECTED_TRAINABLE) | {"vptsp_g"}


@pytest.mark.parametrize("method", sorted(EXPECTED_TRAINABLE))
def test_trainable_set_is_exactly_what_the_method_says(method):
    model = build_model(method_config(method))
    names = [n for n, _ in model.named_parameters()]
    expected = {n for n in names if EXPECTED_TRAINABLE[method](n)}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == expected and trainable
    groups = trainable_parameter_groups(model)
    assert sum(p.numel() for g in groups.values() for p in g) == count_trainable(model)
    backbone_trains = method in ("bitfit", "full_finetune")
    assert bool(groups["backbone"]) == backbone_trains
    assert bool(groups["modules"]) == (method not in ("linear", "mlp3", "bitfit", "full_finetune"))


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("method", sorted(EXPECTED_TRAINABLE))
def test_each_method_trains_and_gradients_reach_exactly_its_trainable_set(method):
    torch.manual_seed(0)
    cfg = dataclasses.replace(Config(), model=method_config(method))
    model = build_model(cfg.model)
    module = build_method_training(cfg, model, num_classes=4).module.train()  # udml_ss: its own
    optimizer = build_optimizer(trainable_parameter_groups(model), module.loss, OptimConfig(lr=1e-3))
    before = snapshot(model)
    labels = torch.arange(4).repeat(4)  # (16,)
    for step in range(2):  # step 0: zero-init up-projections give W_down / A no gradient yet
        out = train_step(module, optimizer, tiny_images(16, seed=step), labels, clip_value=1.0)
        assert all(math.isfinite(v) for v in out.values())
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
            assert not torch.equal(p.detach(), before[name]), name
        else:
            assert p.grad is None, name
            assert torch.equal(p.detach(), before[name]), name  # bit-identical


def test_a_peft_module_the_method_does_not_train_is_an_error():
    model = build_model(method_config("puma"))
    model.method = "linear"  # adapters and a prompt pool built, but the method trains only the head
    with pytest.raises(ConfigError, match="does not train 'adapters'"):
        mark_trainable(model)
    model.method = "my_method"
    with pytest.raises(ConfigError, match="declares no trainable set"):
        mark_trainable(model)


def test_unknown_method_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"valid: \[.*'full_finetune'.*'vpt_shallow'.*'vptsp_g'\]"):
        build_model(tiny_model_config(method="prefix_tuning"))


# ----------------------------------------------------------------------------- heads and adapters


def test_linear_bitfit_and_full_finetune_share_the_plain_architecture():
    torch.manual_seed(0)
    linear = build_model(method_config("linear")).eval()
    x = tiny_images(4)
    for method in ("bitfit", "full_finetune"):
        other = build_model(method_config(method)).eval()
        other.load_state_dict(linear.state_dict())
        with torch.no_grad():
            assert torch.equal(other(x), linear(x))
    assert count_trainable(build_model(method_config("bitfit"))) == (
        DEPTH * (3 * D + D + 4 * D + D + 2 * D) + D + D + (E * D + E))  # per block qkv, proj, fc1, fc2,
    # norm1, norm2; then patch embedding, final norm, head


def test_mlp3_head_is_the_released_384_2048_2048_128_gelu_mlp():
    model = build_model(method_config("mlp3")).eval()
    head = model.head
    assert isinstance(head, MlpEmbeddingHead)
    kinds = [type(m).__name__ for m in head.mlp] + ["Linear"]
    assert kinds == ["Linear", "GELU", "Linear", "GELU", "Linear"]
    assert count_trainable(model) == (D * 2048 + 2048) + (2048 * 2048 + 2048) + (2048 * E + E)
    with torch.no_grad():
        emb = model(tiny_images(3))
    torch.testing.assert_close(emb.norm(dim=1), torch.ones(3))
    assert model.embed_dim == E


def randomise(model, types, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, types):
                m.up.copy_(torch.randn(m.up.shape, generator=gen) * 0.3)


def test_adaptformer_is_static_adapters_without_prompt_pool_whatever_keep_prob_says():
    torch.manual_seed(0)
    model = build_model(method_config("adaptformer", adapter={"keep_prob": 0.5}))
    adapters = [m for m in model.modules() if isinstance(m, StochasticAdapter)]
    assert len(adapters) == 2 * DEPTH and all(a.keep_prob == 1.0 for a in adapters)
    assert model.prompt_pool is None
    randomise(model, StochasticAdapter)
    x = tiny_images(8)
    with torch.no_grad():
        assert torch.equal(model.train()(x), model.eval()(x))  # no stochasticity in training


# ----------------------------------------------------------------------------- LoRA


def first_qkv(model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of block 0's qkv projection for images ``x``."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hook = model.backbone.blocks[0].attn.qkv.register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
    with torch.no_grad():
        model(x)
    hook.remove()
    return seen[0]


def test_lora_starts_as_the_backbone_and_updates_only_its_target_chunks():
    torch.manual_seed(0)
    model = build_model(method_config("lora")).eval()
    plain = build_model(method_config("linear")).eval()
    plain.load_state_dict(model.state_dict(), strict=False)  # same backbone and head, no LoRA keys
    x = tiny_images(4)
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))  # B = 0: LoRA starts as a no-op
    randomise(model, LoraBranch)
    qkv = model.backbone.blocks[0].attn.qkv
    block_input, out = first_qkv(model, x)  # (B, N, D) -> (B, N, 3D)
    with torch.no_grad():
        q, k, v = (out - F.linear(block_input, qkv.weight, qkv.bias)).chunk(3, dim=-1)
    assert q.abs().amax() > 0 and k.abs().amax() > 0 and v.abs().amax() == 0  # q and k updated, v not
    branches = [m for m in model.modules() if isinstance(m, LoraBranch)]
    assert len(branches) == 2 * DEPTH and all(tuple(b.down.shape) == (D, 4) for b in branches)


def test_lora_targets_proj_and_v_and_checks_its_config():
    model = build_model(method_config("lora", lora={"targets": ["v", "proj"], "blocks": [1]}))
    names = [n for n, p in model.named_parameters() if p.requires_grad and not is_head(n)]
    assert sorted(names) == [f"backbone.blocks.1.attn.{n}" for n in (
        "proj.lora.proj.down", "proj.lora.proj.up", "qkv.lora.v.down", "qkv.lora.v.up")]
    with pytest.raises(ConfigError, match="model.lora.targets"):
        method_config("lora", lora={"targets": ["o"]})
    with pytest.raises(ConfigError, match=r"model.lora.blocks has index\(es\) \[5\]"):
        build_model(method_config("lora", lora={"blocks": [5]}))


@pytest.mark.parametrize("keep_prob", [0.5, 0.8])
def test_stochastic_lora_keeps_each_sample_with_probability_p_and_rescales(keep_prob):
    torch.manual_seed(1)
    branch = LoraBranch(8, 8, 4, keep_prob)
    with torch.no_grad():
        branch.up.normal_()
    x = torch.rand(20_000, 3, 8) + 0.1  # (B, N, D)
    with torch.no_grad():
        on, out = branch.eval()(x), branch.train()(x)
    kept = out.abs().sum(dim=(1, 2)) > 0
    torch.testing.assert_close(out[kept], on[kept] / keep_prob)
    assert torch.all(out[~kept] == 0)
    assert abs(kept.float().mean().item() - keep_prob) < 5 * math.sqrt(keep_prob * (1 - keep_prob) / len(x))


def test_puma_with_stochastic_lora_has_adapters_pool_and_stochastic_lora():
    model = build_model(method_config("puma_lora", lora={"keep_prob": 0.5}))
    branches = [m for m in model.modules() if isinstance(m, LoraBranch)]
    assert branches and all(b.keep_prob == 0.5 for b in branches)
    assert model.prompt_pool is not None
    assert sum(isinstance(m, StochasticAdapter) for m in model.modules()) == 2 * DEPTH
    randomise(model, (StochasticAdapter, LoraBranch))
    assert_eval_deterministic_train_stochastic(model, tiny_images(8))


# ----------------------------------------------------------------------------- VPT


def block_inputs(model, x: torch.Tensor) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    hooks = [b.register_forward_pre_hook(lambda m, a: seen.append(a[0])) for b in model.backbone.blocks]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("method, layers", [("vpt_shallow", 1), ("vpt_deep", DEPTH)])
def test_vpt_prompts_follow_cls_at_the_input_and_before_every_block_when_deep(method, layers):
    torch.manual_seed(0)
    model = build_model(method_config(method)).eval()
    assert isinstance(model, VptModel)
    prompts = model.visual_prompts.prompts  # (L, Np, D)
    assert tuple(prompts.shape) == (layers, 3, D)
    assert count_trainable(model) == layers * 3 * D + (E * D + E)
    x = tiny_images(2)
    inputs = block_inputs(model, x)
    vit = model.backbone
    patches = vit.patch_embed(x) + vit.pos_embed[:, 1:]
    first = inputs[0]  # [CLS, P_0 + pos_CLS, patches]
    assert first.shape == (2, 1 + 3 + 16, D)
    torch.testing.assert_close(first[:, 1:4], (prompts[0] + vit.pos_embed[0, :1]).expand(2, -1, -1))
    torch.testing.assert_close(first[:, 4:], patches)
    later = inputs[1][:, 1:4]
    if layers > 1:
        torch.testing.assert_close(later, prompts[1].expand(2, -1, -1))  # replaced by fresh tokens
    else:
        assert not torch.allclose(later, prompts[0].expand(2, -1, -1))  # block 0's prompt outputs
    bound = math.sqrt(6 / (3 * 8 * 8 + D))
    assert prompts.abs().max() <= bound and model.aux_loss().item() == 0.0


# ----------------------------------------------------------------------------- losses


def poincare_reference(x: torch.Tensor, c: float = 0.1, clip_r: float = 2.3) -> torch.Tensor:
    """Hyp's ToPoincare (hyptorch): feature clipping, then expmap at 0."""
    norm = x.norm(dim=-1, keepdim=True) + 1e-5
    x = x * torch.clamp(clip_r / norm, max=1.0)
    u = x.norm(dim=-1, keepdim=True).clamp_min(1e-5)
    return torch.tanh(c**0.5 * u) * x / (c**0.5 * u)


def mobius_distance(x: torch.Tensor, y: torch.Tensor, c: float = 0.1) -> torch.Tensor:
    """(B, M) = 2 / sqrt(c) artanh(sqrt(c) ||(-x_i) (+)_c y_j||), Mobius addition written out."""
    a, b = -x[:, None, :], y[None, :, :]  # (B, 1, E), (1, M, E)
    ab, aa, bb = (a * b).sum(-1, keepdim=True), (a * a).sum(-1, keepdim=True), (b * b).sum(-1, keepdim=True)
    num = (1 + 2 * c * ab + c * bb) * a + (1 - c * aa) * b
    add = num / (1 + 2 * c * ab + c**2 * aa * bb)
    return 2 / c**0.5 * torch.atanh(c**0.5 * add.norm(dim=-1))


def hyp_reference(x0: torch.Tensor, x1: torch.Tensor, tau: float = 0.2) -> torch.Tensor:
    """Hyp's contrastive_loss(x0, x1) and (x1, x0) averaged: x0[i], x1[i] are the positive pair."""
    def one_way(a, b):
        n = len(a)
        self_mask = torch.eye(n) * 1e9
        logits = torch.cat([-mobius_distance(a, b) / tau, -mobius_distance(a, a) / tau - self_mask], 1)
        return F.cross_entropy(logits, torch.arange(n))
    z0, z1 = poincare_reference(x0), poincare_reference(x1)
    return (one_way(z0, z1) + one_way(z1, z0)) / 2


@pytest.mark.parametrize("norms", [(1.0, 1.0), (0.5, 3.0)])  # unit embeddings; and a mix with clipping
def test_hyp_equals_hyps_pairwise_cross_entropy_in_the_poincare_ball(norms):
    torch.manual_seed(0)
    n = 6
    x0 = F.normalize(torch.randn(n, 8, dtype=torch.float64), dim=1) * norms[0]
    x1 = F.normalize(torch.randn(n, 8, dtype=torch.float64), dim=1) * norms[1]
    loss = build_loss(LossConfig(name="hyp"), num_classes=n, embed_dim=8)
    value = loss(torch.cat([x0, x1]), torch.arange(n).repeat(2))  # two images per class, as Hyp samples
    torch.testing.assert_close(value, hyp_reference(x0, x1), rtol=1e-9, atol=1e-9)


def test_supcon_equals_the_supcon_out_formula():
    torch.manual_seed(0)
    emb = F.normalize(torch.randn(9, 5, dtype=torch.float64), dim=1)
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3])  # class 3 has no positive: no loss term
    sim = emb @ emb.T / 0.1
    terms = []
    for i in range(9):
        others = [k for k in range(9) if k != i]
        log_z = torch.logsumexp(sim[i, others], 0)
        pos = [j for j in others if labels[j] == labels[i]]
        if pos:
            terms.append(-sum(sim[i, j] - log_z for j in pos) / len(pos))
    value = build_loss(LossConfig(name="supcon"), 4, 5)(emb, labels)
    torch.testing.assert_close(value, torch.stack(terms).mean())


def test_proxy_nca_pp_is_a_softmax_over_squared_distances_at_temperature_one_ninth():
    torch.manual_seed(0)
    loss = build_loss(LossConfig(name="proxy_nca_pp"), num_classes=5, embed_dim=4)
    emb, labels = torch.randn(7, 4), torch.tensor([0, 1, 2, 3, 4, 0, 1])
    proxies = F.normalize(loss.loss.proxies.detach(), dim=1)
    d2 = torch.cdist(F.normalize(emb, dim=1), proxies) ** 2  # (B, C)
    expected = F.cross_entropy(-9.0 * d2, labels)
    torch.testing.assert_close(loss(emb, labels), expected)
    assert loss.proxy_parameters() == [loss.loss.proxies]
    assert loss.loss.proxies.abs().max() <= math.sqrt(6 / 5)  # kaiming-uniform over the 5 classes


@pytest.mark.parametrize("name", ["hyp", "supcon", "proxy_nca_pp"])
def test_new_losses_give_finite_scalars_with_gradients(name):
    torch.manual_seed(0)
    loss = build_loss(LossConfig(name=name), num_classes=8, embed_dim=16)
    emb = F.normalize(torch.randn(32, 16), dim=1).requires_grad_(True)
    value = loss(emb, torch.arange(8).repeat(4))
    value.backward()
    assert value.ndim == 0 and torch.isfinite(value) and value.item() > 0
    assert torch.isfinite(emb.grad).all() and emb.grad.abs().sum() > 0


def test_hyp_gradient_is_finite_for_identical_embeddings():
    emb = F.normalize(torch.ones(4, 8), dim=1).requires_grad_(True)  # every distance 0
    value = build_loss(LossConfig(name="hyp"), 2, 8)(emb, torch.tensor([0, 0, 1, 1]))
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(emb.grad).all()


def xbm_batches(n: int = 3, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(4).repeat(4)
    return [(F.normalize(torch.randn(16, 8, generator=gen), dim=1), labels) for _ in range(n)]


@pytest.mark.parametrize("name", ["triplet", "margin", "multi_similarity", "supcon", "hyp"])
def test_xbm_first_step_equals_the_plain_loss_then_mines_the_memory(name):
    torch.manual_seed(0)
    plain = build_loss(LossConfig(name=name), 4, 8)
    xbm = build_loss(LossConfig(name=name, xbm_memory_size=40), 4, 8)
    assert isinstance(xbm.loss, CrossBatchMemoryLoss) and xbm.miner is None and xbm.proxy_parameters() == []
    (e0, y0), (e1, y1), (e2, y2) = xbm_batches()
    if name != "margin":  # the distance-weighted miner samples at random; the others are deterministic
        torch.testing.assert_close(xbm(e0, y0), plain(e0, y0))
    else:
        xbm(e0, y0)
    assert xbm.loss.filled == 16
    xbm(e1, y1)
    assert xbm.loss.filled == 32
    e2 = e2.clone().requires_grad_(True)
    value = xbm(e2, y2)  # the queue wraps: 40 items, the last two batches plus 8 of the first
    assert xbm.loss.filled == 40 and torch.isfinite(value)
    value.backward()
    assert torch.isfinite(e2.grad).all() and e2.grad.abs().sum() > 0
    state = xbm.state_dict()
    memory = state["loss.embedding_memory"]  # a buffer: saved with the loss
    assert memory.shape == (40, 8) and torch.equal(memory[32:40], e2.detach()[:8])


def test_xbm_errors_name_the_problem():
    with pytest.raises(ValueError, match="applies to pair-based losses"):
        build_loss(LossConfig(name="curricularface", xbm_memory_size=64), 4, 8)
    with pytest.raises(ConfigError, match="xbm_memory_size"):
        LossConfig(name="triplet", xbm_memory_size=-1)
    small = build_loss(LossConfig(name="triplet", xbm_memory_size=8), 4, 8)
    with pytest.raises(LossInputError, match="batch of 16 does not fit the cross-batch memory of 8"):
        small(*xbm_batches(1)[0])


@pytest.mark.parametrize("loss_cfg", [LossConfig(name="hyp"), LossConfig(name="supcon"),
                                      LossConfig(name="proxy_nca_pp"),
                                      LossConfig(name="multi_similarity", xbm_memory_size=64)])
def test_new_losses_train_a_model_through_train_step(loss_cfg):
    torch.manual_seed(0)
    model = build_model(method_config("linear"))
    loss = build_loss(loss_cfg, num_classes=4, embed_dim=E)
    module = TrainModule(model, loss).train()
    optimizer = build_optimizer(trainable_parameter_groups(model), loss, OptimConfig(lr=1e-3))
    head_before = model.head.proj.weight.detach().clone()
    for step in range(3):
        out = train_step(module, optimizer, tiny_images(16, seed=step), torch.arange(4).repeat(4), 1.0)
        assert math.isfinite(out["loss"])
    assert not torch.equal(model.head.proj.weight, head_before)


def test_a_config_the_method_cannot_train_fails_at_the_driver_before_any_worker(monkeypatch):
    """The record's config check (VPTSP-G: Proxy-Anchor only) and an unknown method: one line, no Ray."""
    from puma.methods import load_config
    from puma.train import driver

    def no_data(*args, **kwargs):
        raise AssertionError("reached the data and the workers")

    monkeypatch.setattr(driver, "build_datasets", no_data)
    vptsp_g = dataclasses.replace(Config(), model=method_config("vptsp_g"))  # loss: curricularface
    with pytest.raises(ConfigError, match=r"^model.method=vptsp_g trains with Proxy-Anchor .* set loss.name="
                                          r"proxy_anchor \(got 'curricularface'\)$"):
        driver.run_training(vptsp_g)
    with pytest.raises(ConfigError, match=r"model.method='prefix_tuning' is not known; valid: \["):
        driver.run_training(dataclasses.replace(Config(), model=method_config("prefix_tuning")))
    with pytest.raises(ConfigError, match="set loss.name=proxy_anchor"):  # and on a job's command line
        load_config(None, ["model.method=vptsp_g"])
    assert load_config(None, ["model.method=vptsp_g", "loss.name=proxy_anchor"]).model.method == "vptsp_g"
