"""Data-driven initialisation before the first step: the PCA head, class-centroid proxies and the
prompt pool's query centre and keys.

One pass over the training images in the eval view with the model as built (adapters are no-ops at
init, prompts as initialised): the features' mean and covariance give the head's PCA projection
(``model.head.init=pca``), then each class's mean embedding gives its proxy
(``loss.proxy_init=centroids``). The prompt pool's centre and keys (``model.prompt_pool.init=data``,
PromptPool.init_from_queries) come from the patch queries' mean and covariance in a pass of their own
before that one (:func:`init_pool_from_data`), so the head and proxies see the pool they will train
with. Statistics are sums, so workers add theirs with ``reduce`` (an all-reduce in place; identity on
one worker) and every rank ends with the same head, proxies and pool. No Ray here; the loop passes
the batches and the reduction.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch import nn

from puma.data.device_views import batch_images
from puma.models.head import FeatureMoments
from puma.models.puma_model import patch_query

Reduce = Callable[[list[torch.Tensor]], None]


def _no_reduce(tensors: list[torch.Tensor]) -> None:
    """One worker: the local sums are the global ones."""


@torch.no_grad()
def _features(model: nn.Module, batches: Iterable[dict], device: torch.device,
              labels_of: Callable[[dict], np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Features (N, D) on CPU and global labels (N,) of every batch."""
    was_training = model.training
    model.eval()
    feats, labels = [], []
    for batch in batches:
        images = batch_images(batch, device)  # (B, 3, H, W)
        feats.append(model.forward_features(images).float().cpu())  # (B, D)
        labels.append(torch.as_tensor(np.asarray(labels_of(batch)), dtype=torch.long))
    model.train(was_training)
    if not feats:
        return torch.zeros(0, model.num_features), torch.zeros(0, dtype=torch.long)
    return torch.cat(feats), torch.cat(labels)


def needs_data_init(cfg) -> bool:
    """Whether ``cfg`` asks for a data-driven start (PCA head, centroid proxies or pool from data)."""
    return cfg.model.head.init == "pca" or cfg.loss.proxy_init == "centroids" or pool_from_data(cfg)


def start_from_data(cfg, model: nn.Module, loss: nn.Module, passes: Callable[[], Iterable[dict]],
                    device: torch.device, labels_of: Callable[[dict], np.ndarray],
                    reduce: Reduce = _no_reduce) -> dict[str, float]:
    """Everything ``cfg`` starts from the data, in order: the pool's centre and keys, then the PCA head
    and/or centroid proxies (``passes()`` gives a new pass over the training images for each)."""
    done = init_pool_from_data(model, passes(), device, reduce) if pool_from_data(cfg) else {}
    head, proxies = cfg.model.head.init == "pca", cfg.loss.proxy_init == "centroids"
    if head or proxies:
        done |= init_from_data(model, loss, passes(), device, labels_of, head=head, proxies=proxies,
                               reduce=reduce)
    return done


def check_data_init(cfg, model: nn.Module) -> None:
    """The data-driven starts ``cfg`` asks for, run on copies of the parts they set with stand-in
    statistics (zero mean, identity covariance): a start the model cannot take (e.g. a PCA head wider
    than the features) raises ValueError here, on the driver, not after a pass over the data in every
    worker."""
    dim = model.num_features
    stand_in = (torch.zeros(dim), torch.eye(dim))
    if pool_from_data(cfg):
        pool = getattr(model, "prompt_pool", None)
        if pool is None:
            raise ValueError("model.prompt_pool.init=data needs a model with a prompt pool")
        copy.deepcopy(pool).init_from_queries(*stand_in)
    if cfg.model.head.init == "pca":
        copy.deepcopy(model.head).init_from_features(*stand_in)


def pool_from_data(cfg) -> bool:
    """Whether the prompt pool's centre and keys start from the training images' queries."""
    return cfg.model.prompt_pool.enabled and cfg.model.prompt_pool.init == "data"


@torch.no_grad()
def init_pool_from_data(model: nn.Module, batches: Iterable[dict], device: torch.device,
                        reduce: Reduce = _no_reduce) -> dict[str, float]:
    """The prompt pool's centre and keys from the patch queries of one pass over ``batches``."""
    pool = getattr(model, "prompt_pool", None)
    if pool is None or pool.centre is None:
        raise ValueError("model.prompt_pool.init=data needs a model built with a centred prompt pool "
                         "(puma.methods.build_model with model.prompt_pool.enabled=true)")
    queries = FeatureMoments(model.num_features)
    for batch in batches:
        queries.add(patch_query(model.backbone.patch_embed(batch_images(batch, device))))  # (B, D)
    reduce(queries.tensors())
    pool.init_from_queries(*queries.mean_cov())
    return {"init/pool_queries": float(queries.count)}


def init_from_data(model: nn.Module, loss: nn.Module, batches: Iterable[dict], device: torch.device,
                   labels_of: Callable[[dict], np.ndarray], head: bool, proxies: bool,
                   reduce: Reduce = _no_reduce) -> dict[str, float]:
    """PCA head and/or centroid proxies from one pass over ``batches``; returns what was done."""
    feats, labels = _features(model, batches, device, labels_of)
    out: dict[str, float] = {}
    if head:
        moments = FeatureMoments(feats.shape[1])
        moments.add(feats)
        reduce(moments.tensors())
        model.head.init_from_features(*moments.mean_cov())
        out["init/images"] = float(moments.count)
    if proxies:
        with torch.no_grad():
            emb = model.head(feats.to(next(model.head.parameters()).device)).double().cpu()  # (N, E)
        num_classes = loss.num_classes
        sums = torch.zeros(num_classes, emb.shape[1], dtype=torch.float64).index_add_(0, labels, emb)
        counts = torch.bincount(labels, minlength=num_classes).to(torch.float64)
        reduce([sums, counts])
        centroids = sums / counts.clamp_min(1.0).unsqueeze(1)
        out["init/proxies"] = float(loss.init_proxies(centroids.float(), counts))
    return out
