"""What a method is: the :class:`Method` record, and the training parts most methods share.

A record (one per file in puma/methods/) says everything the rest of the system asks of a method:

    name          the ``model.method`` it answers to
    build         ModelConfig -> PumaModel: how the building blocks of puma/models are put together
    trainable     the parts that train (puma.models.trainable.PARTS); ``option_parts`` adds those a
                  model option turns on (VPTSP-G's ``bitfit``)
    train_module  (Config, model, num_classes) -> TrainModule: the loss and how a step computes it
                  (default: the model + ``build_loss(cfg.loss)`` on the global batch)
    training      the label source and the epoch hook: :class:`Training` (the data's labels, nothing
                  at epoch start) or the method's own (UDML-SS: pseudo-labels re-clustered on schedule)
    check_config  Config -> None, raises ConfigError for a config the method cannot train with; run
                  on the driver before any worker starts

The total objective of a step is written once, :meth:`TrainModule.objective`: the metric loss,
plus the method's weighted extra terms, plus lambda x the prompt-pool orthogonality penalty
(``model.aux_loss()``). No Ray here; ranks only through puma.distributed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from puma.config import Config, ConfigError, ModelConfig
from puma.distributed import gather_labels, gather_with_grad
from puma.models.puma_model import PumaModel
from puma.models.trainable import PARTS


def refuse_data_init(cfg: Config, head: bool = True, proxies: bool = True) -> None:
    """Raise ConfigError if ``cfg`` asks this method for a data-driven start it cannot take:
    ``model.head.init=pca`` (``head``) or ``loss.proxy_init=centroids`` (``proxies``)."""
    method = cfg.model.method
    if head and cfg.model.head.init != "random":
        raise ConfigError(f"model.head.init={cfg.model.head.init!r} needs the linear embedding head; "
                          f"model.method={method!r} has another: set model.head.init=random")
    if proxies and cfg.loss.proxy_init != "random":
        raise ConfigError(f"loss.proxy_init={cfg.loss.proxy_init!r} needs one learned proxy per class in "
                          f"the loss; model.method={method!r} has none: set loss.proxy_init=random")


class TrainModule(nn.Module):
    """Model + loss in one module (one DDP wrapper covers the proxies); the loss on the global batch."""

    def __init__(self, model: nn.Module, loss: nn.Module):
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        emb = self.model(images)  # (B_local, E)
        emb_all = gather_with_grad(emb.float())  # (B_global, E)
        labels_all = gather_labels(labels)  # (B_global,)
        return self.objective(self.loss(emb_all, labels_all))

    def objective(self, metric_loss: torch.Tensor,
                  **terms: tuple[float, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The total loss: metric loss + sum of weight x term (``name=(weight, term)``) + lambda x
        orthogonality (``model.aux_loss()``); every part is also returned, detached and unweighted."""
        aux = self.model.aux_loss()
        loss = metric_loss
        for weight, term in terms.values():
            loss = loss + weight * term
        out = {"loss": loss + aux, "metric_loss": metric_loss.detach()}
        out.update({name: term.detach() for name, (_, term) in terms.items()})
        out["aux_loss"] = aux.detach()
        return out

    def after_backward(self, optimizer: torch.optim.Optimizer, clip_value: float, grad_scale: float) -> None:
        """Hook after backward and clipping, before the optimiser step (state outside DDP); none here."""


def metric_loss_module(cfg: Config, model: PumaModel, num_classes: int) -> TrainModule:
    """The default train module: the model and ``build_loss(cfg.loss)`` over ``num_classes`` classes."""
    from puma.losses import build_loss  # pytorch-metric-learning: only where a loss is built

    return TrainModule(model, build_loss(cfg.loss, num_classes, cfg.model.head.embed_dim))


class Training:
    """The label source and epoch hook of a supervised method: the data's labels, nothing to refresh.

    The worker loop calls ``on_epoch_start`` before each epoch (its metrics are logged) and
    ``batch_labels`` on every training batch; ``module`` is what it steps.
    """

    needs_labels = True  # the training data must carry labels (False: the method makes its own)
    needs_train_eval = False  # the loop must hand over the training images in the eval view

    def __init__(self, cfg: Config, module: TrainModule) -> None:
        self.module = module

    def on_epoch_start(self, epoch: int, model: nn.Module, device: torch.device,
                       train_eval_batches: Callable[[], Iterable[dict]]) -> dict[str, float]:
        """Nothing to refresh: the labels come with the data."""
        return {}

    def batch_labels(self, batch: dict) -> np.ndarray:
        """The stream's global class ids (B,)."""
        return batch["label"]


def no_option_parts(model: PumaModel) -> tuple[str, ...]:
    """No parts beyond the declared ones."""
    return ()


def no_config_check(cfg: Config) -> None:
    """Every valid Config trains."""


@dataclass(frozen=True)
class Method:
    """One method: how its model is built, what trains, how it trains, what it refuses."""

    name: str
    build: Callable[[ModelConfig], PumaModel]
    trainable: tuple[str, ...]
    option_parts: Callable[[PumaModel], tuple[str, ...]] = no_option_parts
    train_module: Callable[[Config, PumaModel, int], TrainModule] = metric_loss_module
    training: type[Training] = Training
    check_config: Callable[[Config], None] = no_config_check

    def __post_init__(self) -> None:
        unknown = sorted(set(self.trainable) - set(PARTS))
        if unknown:
            raise ConfigError(f"method {self.name!r} declares unknown part(s) {unknown}; "
                              f"valid: {list(PARTS)}")

    def parts(self, model: PumaModel) -> tuple[str, ...]:
        """What ``model`` trains: the declared parts plus those its options add."""
        return self.trainable + self.option_parts(model)

    @property
    def needs_labels(self) -> bool:
        """Whether the method trains on the data's labels (False: it makes its own, e.g. udml_ss)."""
        return self.training.needs_labels

    @property
    def needs_train_eval(self) -> bool:
        """Whether the loop must hand over the training images in the eval view (udml_ss clusters them)."""
        return self.training.needs_train_eval
