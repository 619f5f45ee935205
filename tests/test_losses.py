"""CurricularFace against a hand-written formula, its t statistic and training; the loss factory."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from puma.config import LOSS_NAMES, LossConfig
from puma.losses import PROXY_LOSSES, CurricularFaceLoss, LossInputError, MetricLoss, build_loss

# ----------------------------------------------------------------------------- hand-written reference


def _unit(v: list[float]) -> list[float]:
    norm = math.sqrt(sum(a * a for a in v))
    return [a / norm for a in v]


def reference_curricularface(emb: torch.Tensor, W: torch.Tensor, labels: list[int], s: float, m: float,
                             t: list[float], t_mode: str, mu: float,
                             t_update: str = "before") -> tuple[float, list[float], dict]:
    """CurricularFace with Python floats, one sample and one class at a time; W is (E, C).

    ``t_update``: the batch uses t after ("before") or before ("after") this batch's EMA update.
    Returns the mean loss, t after this batch's EMA update, and counts of the branches taken.
    """
    x = [_unit(row) for row in emb.tolist()]
    w = [_unit(col) for col in W.t().tolist()]
    cos = [[max(-1.0, min(1.0, sum(a * b for a, b in zip(xi, wj, strict=True)))) for wj in w] for xi in x]
    pos = [cos[i][y] for i, y in enumerate(labels)]
    t = list(t)
    t_used = list(t)
    if t_mode == "global":
        t = [mu * t[0] + (1 - mu) * sum(pos) / len(pos)]
    else:
        for c in set(labels):
            members = [pos[i] for i, y in enumerate(labels) if y == c]
            t[c] = mu * t[c] + (1 - mu) * sum(members) / len(members)
    t_used = t if t_update == "before" else t_used
    total, counts = 0.0, {"hard": 0, "easy": 0, "fallback": 0}
    for i, y in enumerate(labels):
        theta = math.acos(pos[i])
        if theta + m < math.pi:
            target = math.cos(theta + m)
        else:
            target = pos[i] - m * math.sin(m)
            counts["fallback"] += 1
        t_i = t_used[y] if t_mode == "per_class" else t_used[0]
        logits = []
        for j, c in enumerate(cos[i]):
            if j == y:
                logits.append(s * target)
            elif target >= c:
                logits.append(s * c)
                counts["easy"] += 1
            else:
                logits.append(s * c * (t_i + c))
                counts["hard"] += 1
        top = max(logits)
        total += top + math.log(sum(math.exp(v - top) for v in logits)) - s * target
    return total / len(labels), t, counts


LABELS = [0, 0, 1, 1, 1, 2, 2, 0]  # class 3 is absent from the batch
T_START = {"per_class": [0.2, -0.1, 0.4, 0.05], "global": [0.3]}


def small_example(t_mode: str, momentum: float = 0.9,
                  t_update: str = "before") -> tuple[CurricularFaceLoss, torch.Tensor]:
    """4 classes, 6-d, float64; sample 0 sits opposite its proxy so theta_y + m > pi (the fallback)."""
    torch.manual_seed(3)
    loss = CurricularFaceLoss(4, 6, margin=0.3, scale=32.0, t_mode=t_mode, t_momentum=momentum,
                              t_update=t_update).double()
    loss.t.copy_(torch.tensor(T_START[t_mode], dtype=torch.float64))
    emb = loss.W.detach().t()[LABELS] * 0.5 + 0.6 * torch.randn(len(LABELS), 6, dtype=torch.float64)
    emb[0] = -loss.W.detach()[:, LABELS[0]] + 0.01 * torch.randn(6, dtype=torch.float64)
    return loss, emb


@pytest.mark.parametrize("t_update", ["after", "before"])
@pytest.mark.parametrize("t_mode", ["per_class", "global"])
def test_curricularface_equals_hand_computation_and_updates_t(t_mode, t_update):
    loss, emb = small_example(t_mode, t_update=t_update)
    W0 = loss.W.detach().clone()
    expected, t_after, counts = reference_curricularface(emb, W0, LABELS, 32.0, 0.3, T_START[t_mode],
                                                         t_mode, mu=0.9, t_update=t_update)
    assert counts["hard"] > 0 and counts["easy"] > 0 and counts["fallback"] == 1  # every branch is exercised
    got = loss(emb, torch.tensor(LABELS))
    assert got.item() == pytest.approx(expected, abs=1e-9)
    assert loss.t.tolist() == pytest.approx(t_after, abs=1e-12)
    # a second batch: the EMA continues from the updated t
    expected2, t_after2, _ = reference_curricularface(emb.flip(0), W0, LABELS[::-1], 32.0, 0.3, t_after,
                                                      t_mode, mu=0.9, t_update=t_update)
    assert loss(emb.flip(0), torch.tensor(LABELS[::-1])).item() == pytest.approx(expected2, abs=1e-9)
    assert loss.t.tolist() == pytest.approx(t_after2, abs=1e-12)


# Step-1 losses of a fresh per-class loss (t = 0) on the seeded example below: "after" (the released
# PUMA code, the default) scores the first batch with t = 0; "before" with t already moved to
# (1 - mu) x the batch's positive cosine. Pinned so a change of order or of the default shows.
STEP1_LOSS = {"after": 5.240455175, "before": 5.608683103}


@pytest.mark.parametrize("t_update", ["after", "before"])
def test_step1_loss_of_each_t_order_is_pinned(t_update):
    torch.manual_seed(11)
    loss = CurricularFaceLoss(4, 6, margin=0.3, scale=32.0, t_momentum=0.9, t_update=t_update).double()
    emb = loss.W.detach().t()[LABELS] * 0.5 + 0.6 * torch.randn(len(LABELS), 6, dtype=torch.float64)
    got = loss(emb, torch.tensor(LABELS)).item()
    expected, _, _ = reference_curricularface(emb, loss.W.detach(), LABELS, 32.0, 0.3, [0.0] * 4,
                                              "per_class", mu=0.9, t_update=t_update)
    assert got == pytest.approx(expected, abs=1e-9)
    assert got == pytest.approx(STEP1_LOSS[t_update], abs=1e-6)


def test_default_t_order_is_the_released_codes():
    assert LossConfig().t_update == "after" and CurricularFaceLoss(4, 6).t_update == "after"
    assert build_loss(LossConfig(t_update="before"), 4, 6).loss.t_update == "before"
    with pytest.raises(ValueError, match="t_update"):
        CurricularFaceLoss(4, 6, t_update="during")


def test_per_class_t_moves_only_classes_in_the_batch():
    loss, emb = small_example("per_class")
    loss(emb, torch.tensor(LABELS))
    t = loss.t.tolist()
    assert t[3] == T_START["per_class"][3]  # class 3 absent: untouched
    assert all(t[c] != T_START["per_class"][c] for c in (0, 1, 2))


@pytest.mark.parametrize("t_mode", ["per_class", "global"])
def test_eval_mode_uses_t_without_updating_it(t_mode):
    loss, emb = small_example(t_mode)
    loss.eval()
    expected, _, _ = reference_curricularface(emb, loss.W.detach(), LABELS, 32.0, 0.3, T_START[t_mode],
                                              t_mode, mu=1.0)  # mu = 1: t stays as it is
    assert loss(emb, torch.tensor(LABELS)).item() == pytest.approx(expected, abs=1e-9)
    assert loss.t.tolist() == T_START[t_mode]


def test_t_modes_differ_and_t_is_saved_in_state_dict():
    per_class, emb = small_example("per_class")
    glob, _ = small_example("global")
    labels = torch.tensor(LABELS)
    assert per_class(emb, labels).item() != pytest.approx(glob(emb, labels).item(), abs=1e-6)
    assert set(per_class.state_dict()) == {"W", "t"} and per_class.state_dict()["t"].shape == (4,)
    assert glob.state_dict()["t"].shape == (1,)
    restored = CurricularFaceLoss(4, 6, t_mode="per_class", t_momentum=0.9).double()
    restored.load_state_dict(per_class.state_dict())
    per_class.eval(), restored.eval()
    assert restored(emb, labels).item() == per_class(emb, labels).item()


def separable_embeddings(num_classes: int = 4, per_class: int = 8, dim: int = 16):
    torch.manual_seed(0)
    centres = F.normalize(torch.randn(num_classes, dim), dim=1)
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    emb = F.normalize(centres[labels] + 0.1 * torch.randn(len(labels), dim), dim=1)
    return emb, labels


@pytest.mark.parametrize("t_mode", ["per_class", "global"])
def test_training_on_separable_embeddings_lowers_the_loss(t_mode):
    emb, labels = separable_embeddings()
    loss = CurricularFaceLoss(4, 16, t_mode=t_mode)
    opt = torch.optim.Adam(loss.parameters(), lr=0.05)
    history = []
    for _ in range(40):
        opt.zero_grad()
        value = loss(emb, labels)
        value.backward()
        opt.step()
        history.append(value.item())
    assert history[-1] < 0.1 * history[0]
    nearest = (emb @ F.normalize(loss.W.detach(), dim=0)).argmax(1)  # (B,) nearest proxy
    assert torch.equal(nearest, labels)


def test_gradients_reach_proxies_and_embeddings_even_at_cosine_one():
    loss = CurricularFaceLoss(5, 8)
    emb = F.normalize(torch.randn(10, 8), dim=1)
    labels = torch.arange(5).repeat(2)
    emb[0] = F.normalize(loss.W.detach()[:, 0], dim=0)  # cos_y = 1 exactly: sin = 0
    emb.requires_grad_(True)
    loss(emb, labels).backward()
    assert torch.isfinite(loss.W.grad).all() and loss.W.grad.abs().sum() > 0
    assert torch.isfinite(emb.grad).all() and emb.grad.abs().sum() > 0


@pytest.mark.parametrize("labels, match", [
    (torch.tensor([0, 1, 5, 2]), r"\[0, 5\).*got \[5\]"),
    (torch.tensor([0, -1, 2, 3]), r"got \[-1\]"),
    (torch.tensor([0.0, 1.0, 2.0, 3.0]), "integer tensor"),
    (torch.tensor([[0, 1, 2, 3]]), "integer tensor"),
    (torch.tensor([0, 1, 2]), "4 embeddings but 3 labels"),
])
def test_bad_labels_raise_clear_errors(labels, match):
    loss = CurricularFaceLoss(5, 8)
    with pytest.raises(LossInputError, match=match):
        loss(torch.randn(4, 8), labels)


def test_bad_embeddings_and_arguments_raise():
    loss = CurricularFaceLoss(5, 8)
    with pytest.raises(LossInputError, match="size 7; this loss expects 8"):
        loss(torch.randn(4, 7), torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="t_mode='both'"):
        CurricularFaceLoss(5, 8, t_mode="both")
    with pytest.raises(ValueError, match="t_momentum"):
        CurricularFaceLoss(5, 8, t_momentum=1.5)
    with pytest.raises(ValueError, match="scale"):
        CurricularFaceLoss(5, 8, scale=0)


def test_proxies_are_kaiming_uniform_over_classes():
    loss = CurricularFaceLoss(300, 128)
    bound = math.sqrt(6 / 300)
    assert loss.W.shape == (128, 300) and loss.proxy_parameters() == [loss.W]
    assert loss.W.abs().max() <= bound and loss.W.abs().max() > 0.9 * bound


# ----------------------------------------------------------------------------- factory


def random_batch(num_classes: int = 8, per_class: int = 4, dim: int = 16, seed: int = 0):
    torch.manual_seed(seed)
    emb = F.normalize(torch.randn(num_classes * per_class, dim), dim=1).requires_grad_(True)
    return emb, torch.arange(num_classes).repeat(per_class)


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_every_factory_loss_gives_a_finite_scalar_with_gradients(name):
    loss = build_loss(LossConfig(name=name), num_classes=8, embed_dim=16)
    assert isinstance(loss, MetricLoss)
    emb, labels = random_batch()
    value = loss(emb, labels)
    assert value.ndim == 0 and torch.isfinite(value) and value.item() > 0
    value.backward()
    assert torch.isfinite(emb.grad).all() and emb.grad.abs().sum() > 0
    proxies = loss.proxy_parameters()
    assert [id(p) for p in proxies] == [id(p) for p in loss.parameters()]  # proxies are the module's params
    assert bool(proxies) == (name in PROXY_LOSSES)
    for p in proxies:
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


def test_factory_takes_s_m_and_t_from_config():
    cfg = LossConfig(name="arcface", scale=64.0, margin=0.5)
    arc = build_loss(cfg, 8, 16).loss
    assert arc.scale == 64.0 and arc.margin == pytest.approx(0.5)  # pml stores radians after init
    cos = build_loss(LossConfig(name="cosface", scale=30.0, margin=0.35), 8, 16).loss
    assert cos.scale == 30.0 and cos.margin == 0.35
    cf = build_loss(LossConfig(t_mode="global", t_momentum=0.9, margin=0.2), 8, 16).loss
    assert (cf.t_mode, cf.t_momentum, cf.margin, cf.scale) == ("global", 0.9, 0.2, 32.0)


def test_factory_checks_inputs():
    with pytest.raises(ValueError, match="num_classes"):
        build_loss(LossConfig(), num_classes=1, embed_dim=16)
    proxy_loss = build_loss(LossConfig(name="proxy_anchor"), 8, 16)
    with pytest.raises(LossInputError, match=r"\[0, 8\)"):
        proxy_loss(torch.randn(4, 16), torch.tensor([0, 1, 2, 8]))
    pair_loss = build_loss(LossConfig(name="triplet"), 8, 16)
    with pytest.raises(LossInputError, match="size 12"):
        pair_loss(torch.randn(4, 12), torch.tensor([0, 1, 0, 1]))


def test_loss_runs_in_full_precision_under_autocast():
    loss = build_loss(LossConfig(), 8, 16).eval()
    emb, labels = random_batch()
    reference = loss(emb, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = loss(emb.to(torch.bfloat16), labels)
    assert inside.dtype == torch.float32 and loss.loss.W.dtype == torch.float32
    assert inside.item() == pytest.approx(reference.item(), rel=2e-2)  # only the bf16 input rounding differs
