"""CurricularFace (Huang et al., CVPR 2020) as a pytorch-metric-learning loss.

With x_i the embedding of sample i (label y_i) and W_j the proxy of class j, both L2-normalised:

    cos_j  = <x_i, W_j>                                            (clamped to [-1, 1])
    T(cos_y) = cos(theta_y + m)          if theta_y + m < pi       (positive: additive angular margin)
             = cos_y - m sin(m)          otherwise                 (keeps T monotone, as ArcFace)
    N(t, cos_j) = cos_j                  if T(cos_y) >= cos_j      (easy negative)
                = cos_j (t + cos_j)      otherwise                 (hard negative, re-weighted by t)
    L_i = -log( e^{s T(cos_y)} / (e^{s T(cos_y)} + sum_{j != y} e^{s N(t, cos_j)}) ),  L = mean_i L_i

t is the curriculum statistic, an EMA of the positive cosine r (paper Eq. 10), updated under
no_grad in training mode only, from the current batch:

    global    : t   <- mu t   + (1 - mu) mean_i cos_{y_i}             (the original CurricularFace)
    per_class : t_c <- mu t_c + (1 - mu) mean_{i: y_i = c} cos_{y_i}  (the released PUMA code;
                only classes present in the batch move, and sample i uses t_{y_i})

``t_update`` says when a batch's update happens relative to its use:

    after  : the batch uses t as earlier batches left it, then t is updated (the released PUMA code)
    before : t is updated from the batch first, then used on it (the original CurricularFace code)

t starts at 0 and is a buffer, so it is saved in the state_dict and, under DDP, broadcast like
any buffer. The loss is computed in full precision even inside an autocast region.
"""

from __future__ import annotations

import math

import torch
from pytorch_metric_learning.losses import LargeMarginSoftmaxLoss
from pytorch_metric_learning.utils import common_functions as c_f
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

from puma.losses.checks import check_embeddings_labels

T_MODES = ("per_class", "global")
T_UPDATES = ("after", "before")


class CurricularFaceLoss(LargeMarginSoftmaxLoss):
    """ArcFace margin on the positive; hard negatives re-weighted by t (per class or global)."""

    def __init__(self, num_classes: int, embedding_size: int, margin: float = 0.3, scale: float = 32.0,
                 t_mode: str = "per_class", t_momentum: float = 0.99, t_update: str = "after", **kwargs):
        _check_args(num_classes, embedding_size, margin, scale, t_mode, t_momentum)
        if t_update not in T_UPDATES:
            raise ValueError(f"t_update={t_update!r} is not valid; choose one of {list(T_UPDATES)}")
        # W: (E, C); kaiming-uniform over the class dimension, bound sqrt(6 / C), as the released code
        kwargs.setdefault("weight_init_func", c_f.TorchInitWrapper(torch.nn.init.kaiming_uniform_,
                                                                   mode="fan_in"))
        super().__init__(num_classes=num_classes, embedding_size=embedding_size, margin=margin,
                         scale=scale, **kwargs)
        self.t_mode = t_mode
        self.t_momentum = float(t_momentum)
        self.t_update = t_update
        self.register_buffer("t", torch.zeros(num_classes if t_mode == "per_class" else 1))

    def init_margin(self) -> None:
        """Additive angular margin m in radians; constants for cos(theta + m) and its fallback."""
        self.margin = float(self.margin)
        self.cos_m, self.sin_m = math.cos(self.margin), math.sin(self.margin)
        self.threshold = math.cos(math.pi - self.margin)  # theta_y < pi - m  <=>  cos_y > threshold
        self.fallback = math.sin(math.pi - self.margin) * self.margin  # = m sin(m)

    def proxy_parameters(self) -> list[torch.nn.Parameter]:
        """The class proxies W (E, C)."""
        return [self.W]

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple=None,
                ref_emb=None, ref_labels=None) -> torch.Tensor:
        """Mean CurricularFace loss over the batch: embeddings (B, E), labels (B,) -> scalar."""
        check_embeddings_labels(embeddings, labels, self.W.shape[0], self.num_classes)
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            return super().forward(embeddings.to(self.W.dtype), labels, indices_tuple, ref_emb, ref_labels)

    def modify_cosine_of_target_classes(self, cos_y: torch.Tensor) -> torch.Tensor:
        """T(cos_y) = cos(theta_y + m), or cos_y - m sin(m) once theta_y + m passes pi."""
        sin_y = (1.0 - cos_y * cos_y).clamp_min(1e-12).sqrt()  # eps keeps the gradient finite at |cos| = 1
        cos_y_plus_m = cos_y * self.cos_m - sin_y * self.sin_m
        return torch.where(cos_y > self.threshold, cos_y_plus_m, cos_y - self.fallback)

    def modulate_negatives(self, cosine: torch.Tensor, target: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """N(t, cos_j): cosines (B, C) above the positive's logit T (B, 1) become cos_j (t + cos_j)."""
        hard = cosine > target  # (B, C)
        return torch.where(hard, cosine * (t + cosine), cosine)

    @torch.no_grad()
    def update_t(self, cos_y: torch.Tensor, labels: torch.Tensor) -> None:
        """EMA of the positive cosine cos_y (B,): one global t, or t_c for each class in the batch."""
        mu, cos_y = self.t_momentum, cos_y.to(self.t.dtype)
        if self.t_mode == "global":
            self.t.mul_(mu).add_((1.0 - mu) * cos_y.mean())
            return
        sums = torch.zeros_like(self.t).index_add_(0, labels, cos_y)  # (C,)
        counts = torch.bincount(labels, minlength=self.num_classes).to(self.t.dtype)  # (C,)
        batch_mean = sums / counts.clamp_min(1.0)
        self.t.copy_(torch.where(counts > 0, mu * self.t + (1.0 - mu) * batch_mean, self.t))

    def t_for(self, labels: torch.Tensor) -> torch.Tensor:
        """The t each sample uses: (B, 1) per class (t_{y_i}), or (1, 1) global."""
        return self.t[labels].unsqueeze(1) if self.t_mode == "per_class" else self.t.view(1, 1)

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        c_f.labels_required(labels)
        c_f.ref_not_supported(embeddings, labels, ref_emb, ref_labels)
        cosine = self.get_cosine(embeddings).clamp(-1.0, 1.0)  # (B, C)
        cos_y = cosine.gather(1, labels.unsqueeze(1))  # (B, 1)
        target = self.modify_cosine_of_target_classes(cos_y)  # (B, 1)
        update = self.training
        if update and self.t_update == "before":
            self.update_t(cos_y.squeeze(1), labels)
        logits = self.modulate_negatives(cosine, target, self.t_for(labels))  # (B, C)
        if update and self.t_update == "after":
            self.update_t(cos_y.squeeze(1), labels)
        logits = self.scale_logits(logits.scatter(1, labels.unsqueeze(1), target))
        miner_weights = lmu.convert_to_weights(indices_tuple, labels, dtype=logits.dtype)  # (B,)
        loss_dict = {"loss": {"losses": self.cross_entropy(logits, labels) * miner_weights,
                              "indices": c_f.torch_arange_from_size(embeddings),
                              "reduction_type": "element"}}
        self.add_weight_regularization_to_loss_dict(loss_dict, self.W.t())
        return loss_dict

    def scale_logits(self, logits: torch.Tensor, *_) -> torch.Tensor:
        return logits * self.scale

    def extra_repr(self) -> str:
        return (f"num_classes={self.num_classes}, embedding_size={self.W.shape[0]}, margin={self.margin}, "
                f"scale={self.scale}, t_mode={self.t_mode!r}, t_momentum={self.t_momentum}, "
                f"t_update={self.t_update!r}")


def _check_args(num_classes: int, embedding_size: int, margin: float, scale: float, t_mode: str,
                t_momentum: float) -> None:
    if not (isinstance(num_classes, int) and num_classes >= 1):
        raise ValueError(f"num_classes={num_classes!r}: expected an int >= 1")
    if not (isinstance(embedding_size, int) and embedding_size >= 1):
        raise ValueError(f"embedding_size={embedding_size!r}: expected an int >= 1")
    if not 0.0 <= margin < math.pi:
        raise ValueError(f"margin={margin!r} (radians) is out of range; valid: 0 <= margin < pi")
    if not scale > 0:
        raise ValueError(f"scale={scale!r} must be > 0")
    if t_mode not in T_MODES:
        raise ValueError(f"t_mode={t_mode!r} is not valid; choose one of {list(T_MODES)}")
    if not 0.0 <= t_momentum <= 1.0:
        raise ValueError(f"t_momentum={t_momentum!r} is out of range; valid: 0 <= t_momentum <= 1")
