"""PUMA model: Table 3 parameter counts, trainability, adapters, prompt pool, backbone weight loading."""

from __future__ import annotations

import copy
import io
import math
import pickle

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from timm.layers import resample_abs_pos_embed
from tiny import TINY_BACKBONE, assert_eval_deterministic_train_stochastic, tiny_images, tiny_model_config

from puma.config import BackboneConfig, ConfigError, ModelConfig, from_dict
from puma.methods import build_model
from puma.models import (
    BackboneWeightsError,
    PromptPool,
    StochasticAdapter,
    count_trainable,
    create_backbone,
    trainable_parameter_groups,
    trainable_state_dict,
)
from puma.models.backbone import NORM_TYPES

# ----------------------------------------------------------------------------- Table 3


def vit_s_config(adapter: bool, pool: bool, pool_size: int = 20) -> ModelConfig:
    """The paper's ViT-S/16 set-up: D = 384, r = 128, M = 20, Np = 8, 128-d head; no weights."""
    return from_dict({
        "backbone": {"name": "vit_small_patch16_224.augreg_in21k_ft_in1k", "weights": "none"},
        "adapter": {"enabled": adapter, "rank": 128},
        "prompt_pool": {"enabled": pool, "pool_size": pool_size, "length": 8},
        "head": {"embed_dim": 128},
    }, ModelConfig)


@pytest.mark.parametrize("adapter, pool, pool_size, expected, table3", [
    (False, True, 1, 53_120, 0.05),  # single prompt + head: P 8x384 + K 384 + A 384 + head 384x128+128
    (False, True, 20, 126_080, 0.13),  # prompt pool + head: 20 x (3072 + 384 + 384) + 49,280
    (True, False, 20, 2_408_576, 2.41),  # adapters + head: 12 blocks x 2 x (384x128 + 128x384) + 49,280
    (True, True, 20, 2_485_376, 2.49),  # PUMA
])
def test_trainable_counts_match_table3(adapter, pool, pool_size, expected, table3):
    model = build_model(vit_s_config(adapter, pool, pool_size))
    assert model.num_features == 384 and len(model.backbone.blocks) == 12
    assert count_trainable(model) == expected
    assert round(expected / 1e6, 2) == table3
    assert count_trainable(model.backbone) + count_trainable(model.head) + (
        count_trainable(model.prompt_pool) if pool else 0) == expected


# ----------------------------------------------------------------------------- trainability


def test_groups_and_state_dict_hold_exactly_the_trainable_tensors():
    model = build_model(tiny_model_config())
    groups = trainable_parameter_groups(model)
    assert groups["backbone"] == []
    assert len(groups["modules"]) == 2 * 2 * 2 + 3  # 2 blocks x 2 adapters x (down, up) + P, K, A
    assert [tuple(p.shape) for p in groups["head"]] == [(16, 48), (16,)]
    state = trainable_state_dict(model)
    assert sum(v.numel() for v in state.values()) == count_trainable(model)
    assert {k.split(".")[0] for k in state} == {"backbone", "prompt_pool", "head"}
    assert all(".adapter_" in k for k in state if k.startswith("backbone."))
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert "backbone.pos_embed" in frozen and "backbone.blocks.0.attn.qkv.weight" in frozen


def test_optimizer_step_changes_only_trainable_tensors():
    torch.manual_seed(0)
    model = build_model(tiny_model_config()).train()
    trainable = trainable_state_dict(model)
    frozen_before = {k: v.clone() for k, v in model.state_dict().items() if k not in trainable}
    trainable_before = {k: v.clone() for k, v in trainable_state_dict(model).items()}
    groups = trainable_parameter_groups(model)
    opt = torch.optim.AdamW([{"params": g} for g in groups.values() if g], lr=1e-2)
    targets = F.normalize(torch.randn(16, 16), dim=1)
    for step in range(2):  # at step 0 W_down gets no gradient (W_up = 0); from step 1 on every tensor does
        opt.zero_grad()
        loss = -(model(tiny_images(16, seed=step)) * targets).sum() + model.aux_loss()
        loss.backward()
        for name, p in model.named_parameters():
            if not p.requires_grad:
                assert p.grad is None, name
            elif step == 1 or not name.endswith(".down"):
                assert p.grad is not None and p.grad.abs().sum() > 0, name
        opt.step()
    for k, v in model.state_dict().items():
        if k in frozen_before:
            assert torch.equal(v, frozen_before[k]), k  # bit-identical
        else:
            assert not torch.equal(v, trainable_before[k]), k


def test_norm_layers_stay_in_eval_mode_while_training():
    model = build_model(tiny_model_config()).train()
    norms = [m for m in model.backbone.modules() if isinstance(m, NORM_TYPES)]
    assert len(norms) == 2 * 2 + 1  # norm1, norm2 per block + final norm
    assert not any(m.training for m in norms)
    assert all(m.training for m in model.modules() if isinstance(m, (StochasticAdapter, PromptPool)))
    assert model.training and model.head.training


# ----------------------------------------------------------------------------- adapters


def plain_backbone_like(model) -> torch.nn.Module:
    """A plain timm ViT carrying the model's backbone weights (adapter keys are the only extra keys)."""
    vit = create_backbone(BackboneConfig(**TINY_BACKBONE))
    state = {k: v for k, v in model.backbone.state_dict().items() if ".adapter_" not in k}
    vit.load_state_dict(state, strict=True)
    return vit.eval()


@pytest.mark.parametrize("train", [True, False])
def test_adapter_only_model_at_init_equals_frozen_backbone_plus_head(train):
    torch.manual_seed(0)
    model = build_model(tiny_model_config(prompt_pool={"enabled": False})).train(train)
    vit = plain_backbone_like(model)
    x = tiny_images(8)
    with torch.no_grad():
        expected = model.head(vit.forward_features(x)[:, 0])  # timm's own forward: final norm, CLS
        assert torch.equal(model(x), expected)


def randomise_adapters(model, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, StochasticAdapter):
                m.up.copy_(torch.randn(m.up.shape, generator=gen))


def test_eval_is_deterministic_and_training_is_stochastic():
    torch.manual_seed(0)
    model = build_model(tiny_model_config())
    randomise_adapters(model)
    assert_eval_deterministic_train_stochastic(model, tiny_images(8))


def test_static_adapter_is_deterministic_in_training():
    torch.manual_seed(0)
    model = build_model(tiny_model_config(adapter={"keep_prob": 1.0}, prompt_pool={"enabled": False}))
    randomise_adapters(model)
    x = tiny_images(8)
    with torch.no_grad():
        assert torch.equal(model.train()(x), model.eval()(x))


@pytest.mark.parametrize("keep_prob", [0.3, 0.5, 0.8])
def test_adapter_keeps_each_sample_with_probability_p_and_rescales(keep_prob):
    torch.manual_seed(1)
    adapter = StochasticAdapter(8, 4, keep_prob)
    with torch.no_grad():
        adapter.up.normal_()
    x = torch.rand(20_000, 3, 8) + 0.1  # (B, N, D), positive so the ReLU branch is nonzero
    with torch.no_grad():
        on = adapter.eval()(x)
        out = adapter.train()(x)
    kept = out.abs().sum(dim=(1, 2)) > 0  # (B,)
    torch.testing.assert_close(out[kept], on[kept] / keep_prob)  # inverted scaling, whole sample
    assert torch.all(out[~kept] == 0)
    sigma = math.sqrt(keep_prob * (1 - keep_prob) / len(x))
    assert abs(kept.float().mean().item() - keep_prob) < 5 * sigma


def test_adapter_masks_are_drawn_independently_per_branch():
    torch.manual_seed(2)
    model = build_model(tiny_model_config(prompt_pool={"enabled": False}))
    randomise_adapters(model)
    masks = []
    adapters = [m for m in model.modules() if isinstance(m, StochasticAdapter)]
    hooks = [a.register_forward_hook(lambda m, i, o: masks.append(o.abs().sum(dim=(1, 2)) > 0))
             for a in adapters]
    with torch.no_grad():
        model.train()(tiny_images(2000))
    for h in hooks:
        h.remove()
    assert len(masks) == 4
    for kept in masks:
        assert abs(kept.float().mean().item() - 0.5) < 5 * math.sqrt(0.25 / 2000)
    agree = (masks[0] == masks[1]).float().mean().item()  # independent: p^2 + (1-p)^2 = 0.5
    assert abs(agree - 0.5) < 5 * math.sqrt(0.25 / 2000)


def test_adapters_on_a_subset_of_blocks():
    model = build_model(tiny_model_config(adapter={"blocks": [1]}))
    kinds = [type(b).__name__ for b in model.backbone.blocks]
    assert kinds == ["Block", "AdaptedBlock"]
    assert count_trainable(model.backbone) == 2 * 2 * 48 * 8
    with pytest.raises(ConfigError, match=r"\[2\] out of range .* 2 blocks"):
        build_model(tiny_model_config(adapter={"blocks": [0, 2]}))


def test_model_survives_deepcopy_and_pickle():
    torch.manual_seed(0)
    model = build_model(tiny_model_config()).eval()
    randomise_adapters(model)
    x = tiny_images(2)
    with torch.no_grad():
        for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert torch.equal(other.eval()(x), model(x))


# ----------------------------------------------------------------------------- prompt pool


def test_prompt_pool_weights_follow_the_cosine_formula():
    pool = PromptPool(dim=2, pool_size=3, length=1)
    with torch.no_grad():
        pool.attention.copy_(torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0], [0.0, 0.0]]))
        pool.keys.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, -2.0]]))
        pool.prompts.copy_(torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[1.0, 1.0]]]))
    q = torch.tensor([[2.0, 4.0]])
    # softmax(A_1) = (.5, .5): q*s = (1, 2); softmax(A_2) = (.75, .25): q*s = (1.5, 1)
    alpha = torch.tensor([[1 / math.sqrt(5), 1 / math.sqrt(3.25), -2 / math.sqrt(5)]])
    torch.testing.assert_close(pool.weights(q), alpha)  # raw cosines: negative allowed, no softmax over m
    expected = torch.tensor([[[alpha[0, 0] + alpha[0, 2], alpha[0, 1] + alpha[0, 2]]]])
    torch.testing.assert_close(pool(q), expected)


def test_prompt_pool_init_and_orthogonality_penalty():
    torch.manual_seed(0)
    pool = PromptPool(dim=16, pool_size=4, length=2)
    flat = pool.prompts.flatten(1)
    assert torch.cdist(flat, flat).add(torch.eye(4)).min() > 0.1  # every P_m different
    torch.testing.assert_close(pool.keys @ pool.keys.T, torch.eye(4))  # orthogonal init
    with torch.no_grad():
        pool.keys.copy_(torch.eye(4, 16))
        pool.attention.copy_(torch.eye(4, 16) * 2)  # A A^T - I = 3 I: mean = 4 * 9 / 16
        pool.prompts.zero_()  # P P^T - I = -I: mean = 4 / 16
    torch.testing.assert_close(pool.ortho_loss(), torch.tensor(0.0 + 36 / 16 + 4 / 16))
    model = build_model(tiny_model_config(prompt_pool={"ortho_weight": 0.5}))
    torch.testing.assert_close(model.aux_loss(), 0.5 * model.prompt_pool.ortho_loss())
    no_pool = build_model(tiny_model_config(prompt_pool={"enabled": False}))
    assert no_pool.aux_loss().item() == 0.0 and no_pool.aux_loss().ndim == 0


def capture_block_input(model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(input of the first block, query seen by the prompt pool) for images ``x``."""
    seen = {}
    h1 = model.backbone.blocks[0].register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    h2 = model.prompt_pool.register_forward_pre_hook(lambda m, a: seen.setdefault("q", a[0]))
    with torch.no_grad():
        model(x)
    h1.remove()
    h2.remove()
    return seen["x"], seen["q"]


def test_prompts_follow_cls_with_its_position_embedding_and_patch_query():
    torch.manual_seed(0)
    model = build_model(tiny_model_config()).eval()
    x = tiny_images(3)
    tokens, query = capture_block_input(model, x)
    vit, n_p = model.backbone, model.prompt_pool.length
    patches = vit.patch_embed(x)  # (B, 16, D) before CLS / position embedding
    assert tokens.shape == (3, 1 + n_p + 16, 48)
    torch.testing.assert_close(query, (patches.mean(1) + patches.amax(1)) / 2)
    assert not query.requires_grad
    pos = vit.pos_embed  # (1, 1 + 16, D)
    torch.testing.assert_close(tokens[:, 0], (vit.cls_token + pos[:, :1]).expand(3, 1, 48)[:, 0])
    torch.testing.assert_close(tokens[:, 1:1 + n_p], model.prompt_pool(query) + pos[:, :1])
    torch.testing.assert_close(tokens[:, 1 + n_p:], patches + pos[:, 1:])


def test_register_tokens_no_embed_class_and_dynamic_image_size():
    kwargs = {**TINY_BACKBONE["model_kwargs"], "reg_tokens": 2, "no_embed_class": True,
              "dynamic_img_size": True}
    model = build_model(tiny_model_config(backbone={"model_kwargs": kwargs})).eval()
    x = tiny_images(2, size=48)  # 6x6 grid on a model built for 4x4
    tokens, query = capture_block_input(model, x)
    vit, n_p = model.backbone, model.prompt_pool.length
    assert tokens.shape == (2, 1 + n_p + 2 + 36, 48)  # [CLS, prompts, reg tokens, patches]
    torch.testing.assert_close(tokens[:, 1:1 + n_p], model.prompt_pool(query))  # CLS has no pos embedding
    torch.testing.assert_close(tokens[:, 1 + n_p:3 + n_p], vit.reg_token.expand(2, -1, -1))
    assert model(x).shape == (2, 16)


def test_embeddings_are_unit_length_and_data_config_from_backbone():
    model = build_model(tiny_model_config()).eval()
    with torch.no_grad():
        emb = model(tiny_images(5))
    assert emb.shape == (5, 16)
    torch.testing.assert_close(emb.norm(dim=1), torch.ones(5))
    cfg = model.data_config()
    assert cfg["mean"] == (0.5, 0.5, 0.5) and cfg["std"] == (0.5, 0.5, 0.5)  # augreg ViT-Ti config
    assert cfg["input_size"] == (3, 32, 32) and cfg["interpolation"] == "bicubic"


def test_unknown_method_and_backbones_are_config_errors():
    with pytest.raises(ConfigError, match="not known; valid: \\[.*'puma'"):
        build_model(tiny_model_config(method="prefix_tuning"))
    with pytest.raises(ConfigError, match="not a timm model"):
        build_model(tiny_model_config(backbone={"name": "vit_nonexistent"}))
    with pytest.raises(ConfigError, match="needs a timm VisionTransformer"):
        create_backbone(BackboneConfig(name="resnet18", weights="none", img_size=32))
    with pytest.raises(ConfigError, match="needs a timm VisionTransformer"):
        create_backbone(BackboneConfig(name="levit_128s", weights="none", img_size=224))
    with pytest.raises(ConfigError, match="img_size"):
        create_backbone(BackboneConfig(**{**TINY_BACKBONE, "model_kwargs": {"img_size": 64}}))


# ----------------------------------------------------------------------------- backbone weights


def tiny_backbone_cfg(weights: str = "none", **kwargs) -> BackboneConfig:
    return BackboneConfig(**{**TINY_BACKBONE, "weights": weights, **kwargs})


def reference_vit(seed: int = 7, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    return create_backbone(tiny_backbone_cfg(**kwargs))


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_load_safetensors_and_weights_only_pth(tmp_path):
    ref = reference_vit()
    save_file(ref.state_dict(), str(tmp_path / "w.safetensors"))
    torch.save({"model": ref.state_dict()}, tmp_path / "w.pth")
    for name in ("w.safetensors", "w.pth"):
        torch.manual_seed(123)  # a different random init, overwritten by the file
        assert_same_weights(create_backbone(tiny_backbone_cfg(str(tmp_path / name))), ref)
    model = build_model(tiny_model_config(backbone={"weights": str(tmp_path / "w.safetensors")}))
    assert torch.equal(model.backbone.pos_embed, ref.pos_embed) and count_trainable(model) > 0


def test_classifier_keys_of_a_checkpoint_are_dropped(tmp_path):
    torch.manual_seed(7)
    with_head = timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=32,
                                  **TINY_BACKBONE["model_kwargs"])
    save_file(with_head.state_dict(), str(tmp_path / "w.safetensors"))
    vit = create_backbone(tiny_backbone_cfg(str(tmp_path / "w.safetensors")))
    assert torch.equal(vit.blocks[1].mlp.fc2.weight, with_head.blocks[1].mlp.fc2.weight)


def test_pos_embed_is_resampled_to_the_model_grid(tmp_path):
    ref = reference_vit(img_size=48)  # 6x6 grid, like DINOv2's 37x37 stored at 518 px
    save_file(ref.state_dict(), str(tmp_path / "w48.safetensors"))
    vit = create_backbone(tiny_backbone_cfg(str(tmp_path / "w48.safetensors")))  # 32 px: 4x4
    expected = resample_abs_pos_embed(ref.pos_embed.detach(), new_size=[4, 4], num_prefix_tokens=1,
                                      interpolation="bicubic", antialias=False)
    assert vit.pos_embed.shape == (1, 17, 48)
    torch.testing.assert_close(vit.pos_embed.detach(), expected)
    assert torch.equal(vit.pos_embed[:, 0], ref.pos_embed[:, 0])  # CLS entry untouched
    assert torch.equal(vit.blocks[0].attn.qkv.weight, ref.blocks[0].attn.qkv.weight)


def test_mismatched_weight_files_name_the_keys(tmp_path):
    state = reference_vit().state_dict()
    del state["blocks.1.norm2.bias"]
    state["blocks.9.extra"] = torch.zeros(3)
    save_file(state, str(tmp_path / "bad.safetensors"))
    with pytest.raises(BackboneWeightsError, match=r"missing keys \['blocks.1.norm2.bias'\].*"
                                                   r"unexpected keys \['blocks.9.extra'\]"):
        create_backbone(tiny_backbone_cfg(str(tmp_path / "bad.safetensors")))
    wide = timm.create_model("vit_tiny_patch16_224", num_classes=0, img_size=32,
                             **{**TINY_BACKBONE["model_kwargs"], "embed_dim": 96})
    save_file(wide.state_dict(), str(tmp_path / "wide.safetensors"))
    with pytest.raises(BackboneWeightsError, match=r"shape mismatches .*cls_token: file \(1, 1, 96\)"):
        create_backbone(tiny_backbone_cfg(str(tmp_path / "wide.safetensors")))


class NotATensor:
    """Any pickled object: weights_only loading must refuse it instead of running its reducer."""


def test_unreadable_or_unsafe_files_are_clear_errors(tmp_path):
    torch.save({"pos_embed": torch.zeros(1), "payload": NotATensor()}, tmp_path / "unsafe.pth")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    cases = {"unsafe.pth": "weights-only", "junk.safetensors": "not a readable safetensors",
             "w.onnx": "unknown file type", "missing.pth": "cannot read"}
    for name, message in cases.items():
        with pytest.raises(BackboneWeightsError, match=message):
            create_backbone(tiny_backbone_cfg(str(tmp_path / name)))


def jax_npz(vit) -> bytes:
    """The ViT's weights laid out as an original JAX/Flax (augreg) .npz checkpoint."""
    d, heads = vit.embed_dim, vit.blocks[0].attn.num_heads
    t = {k: v.detach().numpy() for k, v in vit.state_dict().items()}
    w = {"embedding/kernel": t["patch_embed.proj.weight"].transpose(2, 3, 1, 0),
         "embedding/bias": t["patch_embed.proj.bias"], "cls": t["cls_token"],
         "Transformer/posembed_input/pos_embedding": t["pos_embed"],
         "Transformer/encoder_norm/scale": t["norm.weight"], "Transformer/encoder_norm/bias": t["norm.bias"]}
    for i in range(len(vit.blocks)):
        b, p = f"blocks.{i}.", f"Transformer/encoderblock_{i}/"
        qkv_w, qkv_b = t[b + "attn.qkv.weight"].reshape(3, d, d), t[b + "attn.qkv.bias"].reshape(3, heads, -1)
        for j, n in enumerate(("query", "key", "value")):
            w[f"{p}MultiHeadDotProductAttention_1/{n}/kernel"] = qkv_w[j].T.reshape(d, heads, -1)
            w[f"{p}MultiHeadDotProductAttention_1/{n}/bias"] = qkv_b[j]
        w[f"{p}MultiHeadDotProductAttention_1/out/kernel"] = (
            t[b + "attn.proj.weight"].reshape(d, heads, -1).transpose(1, 2, 0))
        w[f"{p}MultiHeadDotProductAttention_1/out/bias"] = t[b + "attn.proj.bias"]
        for ln, norm in (("LayerNorm_0", "norm1"), ("LayerNorm_2", "norm2")):
            w[f"{p}{ln}/scale"], w[f"{p}{ln}/bias"] = t[f"{b}{norm}.weight"], t[f"{b}{norm}.bias"]
        for r in range(2):
            w[f"{p}MlpBlock_3/Dense_{r}/kernel"] = t[f"{b}mlp.fc{r + 1}.weight"].T
            w[f"{p}MlpBlock_3/Dense_{r}/bias"] = t[f"{b}mlp.fc{r + 1}.bias"]
    buf = io.BytesIO()
    np.savez(buf, **w)
    return buf.getvalue()


def test_load_jax_npz_checkpoint(tmp_path):
    ref = reference_vit()
    (tmp_path / "augreg.npz").write_bytes(jax_npz(ref))
    torch.manual_seed(99)
    assert_same_weights(create_backbone(tiny_backbone_cfg(str(tmp_path / "augreg.npz"))), ref)
    buf = io.BytesIO()
    np.savez(buf, something=np.zeros(3))
    (tmp_path / "other.npz").write_bytes(buf.getvalue())
    with pytest.raises(BackboneWeightsError, match="not a JAX/Flax ViT checkpoint"):
        create_backbone(tiny_backbone_cfg(str(tmp_path / "other.npz")))


def test_unreachable_hub_suggests_offline_weights(monkeypatch):
    real_create = timm.create_model

    def offline_create(name, pretrained=False, **kwargs):  # failure injection: no network
        if pretrained:
            raise OSError("We couldn't connect to 'https://huggingface.co'")
        return real_create(name, pretrained=False, **kwargs)

    monkeypatch.setattr(timm, "create_model", offline_create)
    with pytest.raises(BackboneWeightsError, match="from the hub .*weights to a .safetensors/.pth/.npz file"):
        create_backbone(tiny_backbone_cfg("hub"))
