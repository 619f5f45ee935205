"""What the worker loop asks of a training method; no Ray here.

A method training object has ``module`` (``.model``, ``.loss``; ``forward(images, labels)`` -> a dict
with ``loss``), ``on_epoch_start(epoch, model, device, train_eval_batches)`` -> metrics, and
``batch_labels(batch)`` -> the labels a training batch trains on; ``needs_labels`` says whether the
training data must carry labels, ``needs_train_eval`` whether the loop must be handed the training
images in the eval view. Supervised methods (all but those in METHOD_TRAINING) use
:class:`SupervisedTraining`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch import nn

from puma.config import Config
from puma.train.step import build_train_module
from puma.train.udml_ss import UdmlSsTraining


class SupervisedTraining:
    """The metric loss on the stream's global labels; nothing to do at epoch start.

    The train module is the method's own when it registers one (puma.train.step.TRAIN_MODULES,
    e.g. VPTSP-G's semantic proxies), else the model plus ``build_loss(cfg.loss)``.
    """

    needs_labels = True
    needs_train_eval = False

    def __init__(self, cfg: Config, model: nn.Module, num_classes: int) -> None:
        self.module = build_train_module(cfg, model, num_classes)

    def on_epoch_start(self, epoch: int, model: nn.Module, device: torch.device,
                       train_eval_batches: Callable[[], Iterable[dict]]) -> dict[str, float]:
        """Nothing to refresh: the labels come with the data."""
        return {}

    def batch_labels(self, batch: dict) -> np.ndarray:
        """The stream's global class ids (B,)."""
        return batch["label"]


METHOD_TRAINING: dict[str, type] = {"udml_ss": UdmlSsTraining}


def _training_class(method: str) -> type:
    return METHOD_TRAINING.get(method, SupervisedTraining)


def build_method_training(cfg: Config, model: nn.Module, num_classes: int):
    """The training object of ``cfg.model.method`` (supervised unless registered in METHOD_TRAINING)."""
    return _training_class(cfg.model.method)(cfg, model, num_classes)


def needs_labels(method: str) -> bool:
    """Whether ``method`` trains on the data's labels (False: it makes its own, e.g. udml_ss)."""
    return _training_class(method).needs_labels


def needs_train_eval(method: str) -> bool:
    """Whether the loop needs the training images in the eval view (udml_ss clusters them)."""
    return _training_class(method).needs_train_eval
