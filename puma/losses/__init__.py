"""Metric-learning losses: CurricularFace and a factory over pytorch-metric-learning (PUMA Table 2)."""

from puma.losses.curricularface import CurricularFaceLoss, LossInputError, check_embeddings_labels
from puma.losses.factory import PROXY_LOSSES, MetricLoss, build_loss

__all__ = ["CurricularFaceLoss", "LossInputError", "MetricLoss", "PROXY_LOSSES", "build_loss",
           "check_embeddings_labels"]
