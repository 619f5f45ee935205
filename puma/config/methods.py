"""``model.lora``, ``model.vpt``, ``model.vptsp_g``, ``model.udml_ss``: the sections of the methods
beside PUMA (puma/methods reads them; the config is a lower layer, so they live here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from puma.config.checks import _check, _check_choice, _check_range

LORA_TARGETS = ("q", "k", "v", "proj")


@dataclass
class LoraConfig:
    """LoRA on the attention projections (methods lora, puma_lora); keep_prob < 1: stochastic LoRA."""

    rank: int = 128  # r, the LoRA rank
    keep_prob: float = 1.0  # per-sample Bernoulli keep of each LoRA branch, as the adapters (Table 7: 0.5)
    scale: float = 1.0  # the LoRA output scale, alpha / r
    targets: list[str] = field(default_factory=lambda: ["q", "k"])  # projections with LoRA: q, k, v, proj
    blocks: Optional[list[int]] = None  # blocks with LoRA: null = every block, else indices

    def __post_init__(self) -> None:
        _check_range("model.lora.rank", self.rank, 1, 4096)
        _check(0.0 < self.keep_prob <= 1.0,
               f"model.lora.keep_prob={self.keep_prob!r} is out of range; valid: 0 < p <= 1")
        _check(bool(self.targets) and len(set(self.targets)) == len(self.targets)
               and set(self.targets) <= set(LORA_TARGETS),
               f"model.lora.targets={self.targets!r}: expected distinct names from {list(LORA_TARGETS)}")
        if self.blocks is not None:
            _check(all(isinstance(b, int) and b >= 0 for b in self.blocks),
                   f"model.lora.blocks={self.blocks!r}: expected a list of block indices >= 0")


@dataclass
class VptConfig:
    """Visual prompt tuning (methods vpt_shallow, vpt_deep): Np learned tokens right after CLS."""

    length: int = 8  # Np, learned prompt tokens (vpt_deep: per block)

    def __post_init__(self) -> None:
        _check_range("model.vpt.length", self.length, 1, 1024)


VPTSP_FUSIONS = ("gru", "ema")


@dataclass
class VptspgConfig:
    """VPTSP-G (Ren et al., ICLR 2024): VPT prompts + class-based prompts that make semantic proxies.

    Names follow the paper: N prompts in each of L layers (image path), m class-based prompts in
    each of CLS-L layers (proxy path), GRU (ReLU candidate, Eq. 4-7) or EMA (Eq. 3, lambda) fusion
    into the proxy memory, proxy-bias ratio alpha (Eq. 8), BitFit, and the CPU memory bank of
    class prompts (section 4.4).
    """

    prompt_length: int = 10  # N, visual prompts per layer (paper Table 1: VPT L:12, N:10)
    prompt_layers: Optional[int] = None  # L, the first L blocks get fresh prompts; null: every block
    class_prompt_length: int = 1  # m (CLS-N), class-based prompts per layer
    class_prompt_layers: int = 6  # CLS-L, the first CLS-L blocks get fresh class prompts
    fusion: str = "gru"  # gru (VPTSP-G, Eq. 4-7) | ema (VPTSP-M, Eq. 3)
    gru_activation: str = "relu"  # GRU candidate activation: relu (the paper's) | tanh (a plain GRU)
    ema_lambda: float = 0.1  # lambda of Eq. 3: P_i = normal(P_{i-1} + (1 - lambda) p_i)
    proxy_bias_ratio: float = 0.5  # alpha of Eq. 8: Q = normal((1 - alpha) P + alpha O)
    bitfit: bool = True  # also train every backbone bias ("(B)" rows of the paper)
    memory_bank: bool = True  # class prompts and their AdamW state on CPU; only the batch's on device

    def __post_init__(self) -> None:
        p = "model.vptsp_g"
        _check_range(f"{p}.prompt_length", self.prompt_length, 1, 1024)
        _check(self.prompt_layers is None or self.prompt_layers >= 1,
               f"{p}.prompt_layers={self.prompt_layers!r} must be >= 1 or null (every block)")
        _check_range(f"{p}.class_prompt_length", self.class_prompt_length, 1, 1024)
        _check(self.class_prompt_layers >= 1, f"{p}.class_prompt_layers={self.class_prompt_layers!r} "
                                              "must be >= 1")
        _check_choice(f"{p}.fusion", self.fusion, VPTSP_FUSIONS)
        _check_choice(f"{p}.gru_activation", self.gru_activation, ("relu", "tanh"))
        _check_range(f"{p}.ema_lambda", self.ema_lambda, 0.0, 1.0)
        _check_range(f"{p}.proxy_bias_ratio", self.proxy_bias_ratio, 0.0, 1.0)


@dataclass
class UdmlSsConfig:
    """UDML-SS (Cao et al., "Unsupervised DML via auxiliary rotation loss"): method udml_ss.

    Pseudo-labels: k-means (FAISS, seeded by train.seed) on the current embeddings of the training
    images (eval view) at the start of training and every ``recluster_every`` epochs. Loss (Eq. 7):
    L_MS(un-rotated embeddings, pseudo-labels) + eta * L_rot (4-way rotation cross-entropy); the
    MS loss and its miner use the ``ms_*`` settings below (the MS paper's values, which UDML-SS
    keeps), and the method does not read ``loss.*``. What adapts the backbone is PUMA's: adapters
    and prompt pool as ``model.adapter.enabled`` / ``model.prompt_pool.enabled`` say.
    """

    num_clusters: int = 100  # k, pseudo-classes (paper: 100 for CUB and Cars, 1,000 / 10,000 for SOP)
    recluster_every: int = 1  # epochs between k-means runs (paper: "iteratively"; DeepCluster: 1)
    eta: float = 0.1  # rotation-loss weight (paper: 0.1 CUB and SOP, 0.5 Cars)
    cluster_features_first: bool = True  # first k-means on backbone features, as the paper; then embeddings
    kmeans_niter: int = 20  # k-means iterations per clustering
    kmeans_gpu: bool = True  # FAISS GPU k-means when faiss.get_num_gpus() > 0
    ms_alpha: float = 2.0  # MS loss alpha (positive pairs)
    ms_beta: float = 50.0  # MS loss beta (negative pairs)
    ms_base: float = 0.5  # MS loss lambda (similarity margin)
    ms_epsilon: float = 0.1  # MS miner epsilon (Eq. 3-4)

    def __post_init__(self) -> None:
        _check(self.num_clusters >= 2, f"model.udml_ss.num_clusters={self.num_clusters!r} must be >= 2 "
                                       "(metric learning needs at least two pseudo-classes)")
        _check(self.recluster_every >= 1,
               f"model.udml_ss.recluster_every={self.recluster_every!r} must be >= 1 epoch")
        _check(self.eta >= 0, f"model.udml_ss.eta={self.eta!r} must be >= 0 (0: no rotation loss)")
        _check(self.kmeans_niter >= 1, f"model.udml_ss.kmeans_niter={self.kmeans_niter!r} must be >= 1")
        for name in ("ms_alpha", "ms_beta"):
            _check(getattr(self, name) > 0, f"model.udml_ss.{name}={getattr(self, name)!r} must be > 0")
        _check(self.ms_epsilon >= 0, f"model.udml_ss.ms_epsilon={self.ms_epsilon!r} must be >= 0")
