"""Metric-learning losses: CurricularFace and a factory over pytorch-metric-learning (PUMA Table 2).

Also VPTSP-G's semantic-proxy loss (``semantic_proxy``) and the class-prompt memory bank it holds
(``memory_bank``), and the cross-batch memory (``xbm``). Losses never touch ranks: the train
modules (puma.methods) hand them the global batch.
"""

from puma.losses.curricularface import CurricularFaceLoss, LossInputError, check_embeddings_labels
from puma.losses.factory import PROXY_LOSSES, MetricLoss, build_loss

__all__ = ["CurricularFaceLoss", "LossInputError", "MetricLoss", "PROXY_LOSSES", "build_loss",
           "check_embeddings_labels"]
