"""``loss``, ``optim``, ``train``, ``eval``: what a training run optimises, how, on which workers, and
how it is evaluated along the way."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from puma.config.checks import _check, _check_choice, _check_custom_resources, _check_range

# ----------------------------------------------------------------------------- loss, optimiser

LOSS_NAMES = ("curricularface", "arcface", "cosface", "proxy_anchor", "softtriple",
              "triplet", "margin", "multi_similarity", "hyp", "supcon", "proxy_nca_pp")


ONE_PROXY_PER_CLASS = ("curricularface", "arcface", "cosface", "proxy_anchor", "proxy_nca_pp")


@dataclass
class LossConfig:
    name: str = "curricularface"  # metric loss (LOSS_NAMES: curricularface, arcface, proxy_anchor, ...)
    scale: float = 32.0  # s, logit scale of the margin losses (CurricularFace, ArcFace, CosFace)
    margin: float = 0.3  # m, the angular / additive margin
    t_mode: str = "per_class"  # CurricularFace hard-negative statistic t: per_class | global
    t_momentum: float = 0.99  # EMA momentum of CurricularFace's t
    t_update: str = "after"  # after: a batch uses earlier batches' t, then updates it (released) | before
    proxy_init: str = "random"  # random (kaiming-uniform) | centroids: each class's mean initial embedding
    xbm_memory_size: int = 0  # cross-batch memory (XBM) for pair-based losses; 0: off

    def __post_init__(self) -> None:
        _check_choice("loss.name", self.name, LOSS_NAMES)
        _check(self.xbm_memory_size >= 0, f"loss.xbm_memory_size={self.xbm_memory_size!r} must be >= 0 "
                                          "(0: no cross-batch memory)")
        _check_choice("loss.t_mode", self.t_mode, ("per_class", "global"))
        _check_choice("loss.t_update", self.t_update, ("after", "before"))
        _check_choice("loss.proxy_init", self.proxy_init, ("random", "centroids"))
        _check(self.proxy_init == "random" or self.name in ONE_PROXY_PER_CLASS,
               f"loss.proxy_init=centroids needs a loss with one learned proxy per class "
               f"{list(ONE_PROXY_PER_CLASS)}; loss.name={self.name!r} has none (or several per class)")
        _check(self.scale > 0, f"loss.scale={self.scale!r} must be > 0")
        _check_range("loss.t_momentum", self.t_momentum, 0.0, 1.0)


@dataclass
class OptimConfig:
    """AdamW with per-group learning-rate multipliers and step decay (DESIGN.md section 1)."""

    lr: float = 1e-4  # base learning rate of AdamW (groups scale it by their *_lr_mult)
    weight_decay: float = 1e-4  # AdamW weight decay
    module_lr_mult: float = 10.0  # learning-rate multiplier of adapters, prompts (and the head by default)
    head_lr_mult: Optional[float] = None  # learning-rate multiplier of the head; null: module_lr_mult
    proxy_lr_mult: float = 1e4  # learning-rate multiplier of the loss proxies
    warmup_steps: int = 0  # linear learning-rate warm-up over the first optimiser steps; 0: none
    backbone_lr_mult: float = 1.0  # learning-rate multiplier of backbone weights (methods that train them)
    step_epochs: int = 20  # the learning rate is multiplied by gamma every step_epochs epochs
    gamma: float = 0.5  # learning-rate decay factor of each step
    clip_value: float = 1.0  # gradients clipped by value to +-clip_value

    def __post_init__(self) -> None:
        _check(self.lr > 0, f"optim.lr={self.lr!r} must be > 0")
        _check(self.weight_decay >= 0, "optim.weight_decay must be >= 0")
        _check(self.step_epochs >= 1, "optim.step_epochs must be >= 1")
        _check_range("optim.gamma", self.gamma, 0.0, 1.0)
        _check(self.clip_value > 0, "optim.clip_value must be > 0")
        for key in ("module_lr_mult", "proxy_lr_mult", "backbone_lr_mult"):
            _check(getattr(self, key) > 0, f"optim.{key}={getattr(self, key)!r} must be > 0")
        _check(self.head_lr_mult is None or self.head_lr_mult > 0,
               f"optim.head_lr_mult={self.head_lr_mult!r} must be > 0, or null (= module_lr_mult)")
        _check(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps!r} must be >= 0 (0: none)")


# ----------------------------------------------------------------------------- training


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class TrainConfig:
    epochs: int = 100  # training epochs
    batch_size: int = 720  # global batch, drawn uniformly from the union
    num_workers: int = 1  # Ray Train workers (DDP ranks)
    use_gpu: bool = False  # one GPU share per worker (train.gpus_per_worker)
    cpus_per_worker: float = 1.0  # CPUs reserved per worker (fractional leaves room for decoding)
    gpus_per_worker: float = 1.0  # GPUs per worker when train.use_gpu
    precision: str = "bf16"  # autocast dtype on GPU: bf16 | fp16 | fp32
    seed: int = 0  # seeds model init, shuffles and augmentation
    max_steps_per_epoch: Optional[int] = None  # cap on optimiser steps per epoch (null: the whole epoch)
    storage_path: str = "artifacts/runs"  # where runs live (local or s3://): <storage_path>/<run_name>
    run_name: str = "puma"  # the run's folder; re-running the same name resumes it
    eval_every: int = 1  # epochs between evaluations (0: never)
    eval_before: bool = True  # also evaluate the frozen backbone before training (the 'before' column)
    eval_split: str = "test"  # split evaluated during training: test | val (sweeps use val)
    best_metric: str = "harmonic/r@1"  # the metric that picks <run>/best
    max_failures: int = 2  # worker failures Ray Train recovers from (restarting from the last checkpoint)
    checkpoints_to_keep: int = 2  # the newest checkpoints kept (best/ is kept apart)
    placement_strategy: str = "PACK"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD (one worker per node)
    worker_resources: dict = field(default_factory=dict)  # custom Ray resources per worker, e.g. {pool_a: 1}:
    # pins workers to the nodes that offer them (`ray start --resources`)

    def __post_init__(self) -> None:
        _check(self.epochs >= 1, "train.epochs must be >= 1")
        _check_choice("train.placement_strategy", self.placement_strategy, PLACEMENT_STRATEGIES)
        _check_custom_resources("train.worker_resources", self.worker_resources)
        _check(self.batch_size >= 2, "train.batch_size must be >= 2 (metric learning needs pairs)")
        _check(self.num_workers >= 1, "train.num_workers must be >= 1")
        _check_choice("train.precision", self.precision, ("bf16", "fp16", "fp32"))
        _check_choice("train.eval_split", self.eval_split, ("test", "val"))
        _check(self.cpus_per_worker > 0, "train.cpus_per_worker must be > 0")


@dataclass
class EvalConfig:
    ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # the k of the Recall@k reported
    batch_size: int = 128  # images per forward pass when embedding for evaluation
    query_chunk: int = 4096  # queries searched at once (bounds the similarity matrix in memory)

    def __post_init__(self) -> None:
        _check(len(self.ks) > 0 and all(k >= 1 for k in self.ks), "eval.ks must be positive ints")
