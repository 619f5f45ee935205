"""``build_loss``: the metric-learning losses of PUMA Table 2, over pytorch-metric-learning 2.9.

Every loss is returned as a :class:`MetricLoss` (``forward(embeddings (B, E), labels (B,)) ->
scalar``); its proxies, if any, are ordinary parameters of that module, also listed by
``proxy_parameters()`` (empty for pair losses). The paper keeps "the other losses at their
default settings" (appendix A); the settings used, with their source:

=================  ==========================================================================
curricularface     CurricularFaceLoss(m = loss.margin, s = loss.scale, t_mode, t_momentum, t_update);
                   paper: s = 32, m = 0.3
arcface            ArcFaceLoss(m = loss.margin (radians), s = loss.scale); ArcFace's own
                   defaults are s = 64, m = 0.5, which the released code used
cosface            CosFaceLoss(m = loss.margin, s = loss.scale); CosFace's own defaults are
                   s = 64, m = 0.35, which the released code used
proxy_anchor       ProxyAnchorLoss(margin 0.1, alpha 32): the Proxy-Anchor paper's values
softtriple         SoftTripleLoss(10 centres per class, lambda 20, gamma 0.1, margin 0.01):
                   the SoftTriple paper's values (pml's defaults, and the released code's)
triplet            TripletMarginLoss(margin 0.05, cosine similarity) + BatchHardMiner, as the
                   released code
margin             MarginLoss(margin 0.2, beta 1.2 fixed, nu 0) + DistanceWeightedMiner(cutoff
                   0.5, nonzero_loss_cutoff 1.4): the sampling of Wu et al. 2017
multi_similarity   MultiSimilarityLoss(alpha 2, beta 50, base 0.5) + MultiSimilarityMiner
                   (epsilon 0.1): the MS paper's pair mining
hyp                SupConLoss over the Poincare-ball distance (c 0.1, clip_r 2.3, tau 0.2):
                   Hyp's pairwise cross-entropy and settings (puma/losses/hyperbolic.py)
supcon             SupConLoss(temperature 0.1, cosine): the SupCon paper's value (pml default;
                   the released code's SupCon is Hyp's loss with c = 0 and tau 0.1)
proxy_nca_pp       ProxyNCALoss(softmax_scale 9 = 1 / T, squared L2 of normalised embeddings and
                   proxies): ProxyNCA++'s T = 1/9 (the released code set 9 but never used it)
=================  ==========================================================================

``loss.xbm_memory_size > 0`` wraps a pair-based loss (triplet, margin, multi_similarity, supcon,
hyp) and its miner in a cross-batch memory of that many embeddings (puma/losses/xbm.py).

Single-proxy losses initialise proxies kaiming-uniform over the class dimension (bound
sqrt(6 / C)), as the released code does for PA, CosFace, ArcFace and CurricularFace.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from pytorch_metric_learning import distances, losses, miners
from pytorch_metric_learning.utils import common_functions as c_f
from torch import nn

from puma.config import LOSS_NAMES, LossConfig
from puma.losses.checks import check_embeddings_labels
from puma.losses.curricularface import CurricularFaceLoss
from puma.losses.hyperbolic import hyp_loss
from puma.losses.xbm import CrossBatchMemoryLoss

PROXY_LOSSES = ("curricularface", "arcface", "cosface", "proxy_anchor", "softtriple", "proxy_nca_pp")
XBM_LOSSES = ("triplet", "margin", "multi_similarity", "supcon", "hyp")  # pair-based: XBM applies


class MetricLoss(nn.Module):
    """A pml loss plus an optional miner: forward(embeddings (B, E), labels (B,)) -> scalar."""

    def __init__(self, loss: nn.Module, miner: nn.Module | None = None, embedding_size: int | None = None,
                 num_classes: int | None = None):
        super().__init__()
        self.loss = loss
        self.miner = miner
        self.embedding_size = embedding_size
        self.num_classes = num_classes  # labels are range-checked only for losses with class proxies

    def proxy_parameters(self) -> list[nn.Parameter]:
        """The loss's learnable proxies (empty for pair losses)."""
        return list(self.loss.parameters())

    @torch.no_grad()
    def init_proxies(self, centroids: torch.Tensor, counts: torch.Tensor) -> int:
        """Point each class's proxy at its centroid (C, E) where counts (C,) > 0; returns how many moved.

        Proxies keep their mean initial norm (the optimiser's step size relative to them is unchanged);
        classes without images keep their random proxy.
        """
        proxies = self.proxy_parameters()
        if len(proxies) != 1 or self.num_classes is None:
            raise ValueError(f"loss.proxy_init=centroids needs a loss with one proxy per class; "
                             f"{type(self.loss).__name__} has {len(proxies)} proxy tensor(s)")
        weight = proxies[0]
        by_class = weight.T if weight.shape == (self.embedding_size, self.num_classes) else weight  # (C, E)
        if by_class.shape != centroids.shape:
            raise ValueError(f"centroids of shape {tuple(centroids.shape)} do not fit proxies of shape "
                             f"{tuple(weight.shape)}")
        present = counts > 0
        norm = by_class.norm(dim=1).mean()
        by_class[present] = F.normalize(centroids[present].to(by_class), dim=1) * norm
        return int(present.sum())

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        check_embeddings_labels(embeddings, labels, self.embedding_size, self.num_classes)
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            embeddings = embeddings.to(self._compute_dtype(embeddings))
            indices_tuple = self.miner(embeddings, labels) if self.miner is not None else None
            return self.loss(embeddings, labels, indices_tuple)

    def _compute_dtype(self, embeddings: torch.Tensor) -> torch.dtype:
        """The proxies' dtype, else at least float32 (never compute a loss in half precision)."""
        proxies = self.proxy_parameters()
        return proxies[0].dtype if proxies else torch.promote_types(embeddings.dtype, torch.float32)


def build_loss(cfg: LossConfig, num_classes: int, embed_dim: int) -> MetricLoss:
    """The loss named by ``cfg.name`` for ``num_classes`` training classes and ``embed_dim``-d embeddings."""
    if cfg.name not in _BUILDERS:
        raise ValueError(f"loss.name={cfg.name!r} is not valid; choose one of {list(LOSS_NAMES)}")
    if not (isinstance(num_classes, int) and num_classes >= 2):
        raise ValueError(f"num_classes={num_classes!r}: metric learning needs an int >= 2")
    if not (isinstance(embed_dim, int) and embed_dim >= 1):
        raise ValueError(f"embed_dim={embed_dim!r}: expected an int >= 1")
    try:
        loss, miner = _BUILDERS[cfg.name](cfg, num_classes, embed_dim)
    except ValueError as exc:  # the loss's own rule, named by the config keys that feed it
        why = str(exc)
        key = why.split("=", 1)[0]
        raise ValueError(f"loss.name={cfg.name!r}: {'loss.' if key.isidentifier() else ''}{why}") from exc
    if cfg.xbm_memory_size > 0:
        loss, miner = _with_xbm(cfg, loss, miner, embed_dim), None
    with_proxies = cfg.name in PROXY_LOSSES
    return MetricLoss(loss, miner, embed_dim, num_classes if with_proxies else None)


def _class_dim_uniform(mode: str) -> c_f.TorchInitWrapper:
    """kaiming-uniform with the fan taken over the class dimension (``mode`` names which it is)."""
    return c_f.TorchInitWrapper(nn.init.kaiming_uniform_, mode=mode)


def _curricularface(cfg: LossConfig, num_classes: int, embed_dim: int):
    return CurricularFaceLoss(num_classes, embed_dim, margin=cfg.margin, scale=cfg.scale,
                              t_mode=cfg.t_mode, t_momentum=cfg.t_momentum,
                              t_update=cfg.t_update), None


def _arcface(cfg: LossConfig, num_classes: int, embed_dim: int):
    # pml takes the angular margin in degrees; the config gives radians (ArcFace paper: m = 0.5)
    return losses.ArcFaceLoss(num_classes, embed_dim, margin=math.degrees(cfg.margin), scale=cfg.scale,
                              weight_init_func=_class_dim_uniform("fan_in")), None  # W: (E, C)


def _cosface(cfg: LossConfig, num_classes: int, embed_dim: int):
    return losses.CosFaceLoss(num_classes, embed_dim, margin=cfg.margin, scale=cfg.scale,
                              weight_init_func=_class_dim_uniform("fan_in")), None  # W: (E, C)


def _proxy_anchor(cfg: LossConfig, num_classes: int, embed_dim: int):
    return losses.ProxyAnchorLoss(num_classes, embed_dim, margin=0.1, alpha=32,
                                  weight_init_func=_class_dim_uniform("fan_out")), None  # proxies: (C, E)


def _softtriple(cfg: LossConfig, num_classes: int, embed_dim: int):
    return losses.SoftTripleLoss(num_classes, embed_dim, centers_per_class=10, la=20, gamma=0.1,
                                 margin=0.01), None


def _triplet(cfg: LossConfig, num_classes: int, embed_dim: int):
    cosine = distances.CosineSimilarity()
    return losses.TripletMarginLoss(margin=0.05, distance=cosine), miners.BatchHardMiner(distance=cosine)


def _margin(cfg: LossConfig, num_classes: int, embed_dim: int):
    return (losses.MarginLoss(margin=0.2, nu=0.0, beta=1.2, learn_beta=False),
            miners.DistanceWeightedMiner(cutoff=0.5, nonzero_loss_cutoff=1.4))


def _multi_similarity(cfg: LossConfig, num_classes: int, embed_dim: int):
    return (losses.MultiSimilarityLoss(alpha=2, beta=50, base=0.5),
            miners.MultiSimilarityMiner(epsilon=0.1))


def _hyp(cfg: LossConfig, num_classes: int, embed_dim: int):
    return hyp_loss(), None


def _supcon(cfg: LossConfig, num_classes: int, embed_dim: int):
    return losses.SupConLoss(temperature=0.1), None


def _proxy_nca_pp(cfg: LossConfig, num_classes: int, embed_dim: int):
    return losses.ProxyNCALoss(num_classes, embed_dim, softmax_scale=9.0,
                               weight_init_func=_class_dim_uniform("fan_out")), None  # proxies: (C, E)


def _with_xbm(cfg: LossConfig, loss: nn.Module, miner: nn.Module | None, embed_dim: int) -> nn.Module:
    """The pair-based ``loss`` and its miner inside a cross-batch memory of loss.xbm_memory_size."""
    if cfg.name not in XBM_LOSSES:
        raise ValueError(f"loss.xbm_memory_size={cfg.xbm_memory_size} applies to pair-based losses "
                         f"{list(XBM_LOSSES)}, not {cfg.name!r}; set it to 0")
    return CrossBatchMemoryLoss(loss, embed_dim, memory_size=cfg.xbm_memory_size, miner=miner)


def _builder(name: str) -> Callable:
    """The builder of loss ``name``: the function ``_<name>`` above (one per entry of LOSS_NAMES)."""
    return globals()[f"_{name}"]


_BUILDERS: dict[str, Callable] = {name: _builder(name) for name in LOSS_NAMES}  # the names: puma.config
