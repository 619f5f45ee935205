"""UDML-SS (Cao, Chen and Lim): unsupervised metric learning on k-means pseudo-labels plus rotations.

Paper Eq. 7, the objective of a step:

    L = L_MS(g(f(x)), y) + eta * L_rot(h(f(rot_k(x))), k)

x are the un-rotated (augmented) training images and y their k-means pseudo-labels
(puma.data.pseudo_labels, section 3.2), re-clustered at the start of every ``recluster_every``-th
epoch: the first time on the backbone features (the paper's start), then on the embeddings. The MS
loss and its miner (Eq. 3-5) see only the un-rotated embeddings of the global batch. Every image is
also turned by k x 90 degrees, k drawn per sample from a generator seeded by train.seed (the same
stream on every rank), and the rotation head predicts k (Eq. 6). The paper turns 16 images of each
batch all four ways (Eq. 6 sums the four); here each image gets one draw, so L_rot is the mean
cross-entropy over the batch.

What adapts the backbone f is PUMA's (adapters and prompt pool as ``model.adapter.enabled`` /
``model.prompt_pool.enabled`` say), shared by both tasks; the model is puma.models.udml_ss. It needs
no labels, so it trains on catalogues prepared without them; ``loss.*`` is not read (``model.udml_ss``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from puma.config import Config, ModelConfig, UdmlSsConfig
from puma.data.pseudo_labels import PseudoLabels, embed_items
from puma.distributed import gather_labels, gather_with_grad
from puma.methods import puma
from puma.methods.method import Method, Training, TrainModule, refuse_data_init
from puma.models.rotation import draw_rotations, rotate_images
from puma.models.udml_ss import UdmlSsModel

if TYPE_CHECKING:  # the loss modules load where a loss is built (puma/losses/__init__.py)
    from puma.losses.factory import MetricLoss


def build(cfg: ModelConfig) -> UdmlSsModel:
    """PUMA's backbone adaptation and embedding head, plus the rotation head."""
    model = puma.build(cfg)
    return UdmlSsModel(model.backbone, model.head, model.prompt_pool, ortho_weight=model.ortho_weight)


def build_ms_loss(cfg: UdmlSsConfig, embed_dim: int) -> MetricLoss:
    """Multi-similarity loss + miner with the MS paper's settings (UDML-SS section 3.3)."""
    from pytorch_metric_learning import losses, miners

    from puma.losses.factory import MetricLoss

    return MetricLoss(losses.MultiSimilarityLoss(alpha=cfg.ms_alpha, beta=cfg.ms_beta, base=cfg.ms_base),
                      miners.MultiSimilarityMiner(epsilon=cfg.ms_epsilon), embed_dim)


class UdmlSsTrainModule(TrainModule):
    """Model + MS loss on the global batch of un-rotated embeddings + eta x local rotation loss."""

    def __init__(self, model: UdmlSsModel, loss: MetricLoss, eta: float, seed: int) -> None:
        if not isinstance(model, UdmlSsModel):
            raise TypeError(f"UDML-SS trains a UdmlSsModel (model.method=udml_ss), "
                            f"got {type(model).__name__}")
        super().__init__(model, loss)
        self.eta = eta
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        turns = draw_rotations(images.shape[0], self.generator).to(images.device)  # (B,)
        emb, logits = self.model.embed_and_rotation_logits(images, rotate_images(images, turns))
        emb_all = gather_with_grad(emb.float())  # (B_global, E), un-rotated only
        metric_loss = self.loss(emb_all, gather_labels(labels))
        rotation_loss = F.cross_entropy(logits.float(), turns)  # (B, 4) vs (B,)
        return self.objective(metric_loss, rotation_loss=(self.eta, rotation_loss))


def train_module(cfg: Config, model: UdmlSsModel, num_classes: int = 0) -> UdmlSsTrainModule:
    """The MS loss and the rotation task; ``num_classes`` is not used (the pseudo-classes are k clusters)."""
    u = cfg.model.udml_ss
    return UdmlSsTrainModule(model, build_ms_loss(u, cfg.model.head.embed_dim), u.eta, cfg.train.seed)


class UdmlSsTraining(Training):
    """Pseudo-labels per batch (by item_id), re-clustered at the start of an epoch when due."""

    needs_labels = False  # trains on catalogues without labels
    needs_train_eval = True  # clusters the training images in the eval view

    def __init__(self, cfg: Config, module: TrainModule) -> None:
        super().__init__(cfg, module)
        u = cfg.model.udml_ss
        self.cfg = u
        self.pseudo_labels = PseudoLabels(u.num_clusters, u.recluster_every, cfg.train.seed, u.kmeans_niter,
                                          u.kmeans_gpu)

    def on_epoch_start(self, epoch: int, model: UdmlSsModel, device: torch.device,
                       train_eval_batches: Callable[[], Iterable[dict]]) -> dict[str, float]:
        """Re-cluster when due: the first time on backbone features (paper), then on embeddings."""
        features = self.cfg.cluster_features_first and epoch == 0

        def embed_fn(x: torch.Tensor) -> torch.Tensor:
            return F.normalize(model.forward_features(x), dim=-1) if features else model(x)

        def embed() -> tuple[np.ndarray, np.ndarray]:
            model.eval()
            try:
                return embed_items(embed_fn, train_eval_batches(), device)
            finally:
                model.train()

        return self.pseudo_labels.refresh(epoch, embed)

    def batch_labels(self, batch: dict) -> np.ndarray:
        """The pseudo-labels of a training batch, by item_id."""
        return self.pseudo_labels.lookup(batch["item_id"])


def check_config(cfg: Config) -> None:
    """No labels to start from: the PCA head and centroid proxies need the training classes."""
    refuse_data_init(cfg)


UDML_SS = Method(name="udml_ss", build=build, trainable=("adapters", "prompt_pool", "head", "rotation_head"),
                 train_module=train_module, training=UdmlSsTraining, check_config=check_config)
