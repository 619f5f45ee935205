"""Metric-learning losses: CurricularFace and a factory over pytorch-metric-learning (PUMA Table 2).

Also VPTSP-G's semantic-proxy loss (``semantic_proxy``) and the class-prompt memory bank it holds
(``memory_bank``), and the cross-batch memory (``xbm``). Losses never touch ranks: the train
modules (puma.methods) hand them the global batch.

The names below load on first use: a process that only builds models (an embedding actor, a service
replica) imports puma.methods, hence this package, without pytorch-metric-learning and scipy (about a
second of CPU per process).
"""

from __future__ import annotations


def __getattr__(name: str):
    if name in ("LossInputError", "check_embeddings_labels"):
        from puma.losses import checks
        return getattr(checks, name)
    if name == "CurricularFaceLoss":
        from puma.losses.curricularface import CurricularFaceLoss
        return CurricularFaceLoss
    if name in ("MetricLoss", "PROXY_LOSSES", "build_loss"):
        from puma.losses import factory
        return getattr(factory, name)
    raise AttributeError(f"module 'puma.losses' has no attribute {name!r}")


__all__ = ["CurricularFaceLoss", "LossInputError", "MetricLoss", "PROXY_LOSSES", "build_loss",
           "check_embeddings_labels"]
