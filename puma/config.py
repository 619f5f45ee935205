"""Typed, layered configuration: defaults -> YAML file -> dotted ``key=value`` overrides.

Every section is a dataclass that validates itself in ``__post_init__``. The same dotted
keys are used by ``jobs/*.py`` overrides and by ``tune/`` search spaces, so a key that is
not a field here is an error everywhere.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import io
import json
import tokenize
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from puma import storage
from puma.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration key or value is invalid; the message says which and what is valid."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    _check(lo <= value <= hi, f"{name}={value!r} is out of range; valid: {lo} <= {name} <= {hi}")


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _check_custom_resources(name: str, value: dict) -> None:
    """{resource name: amount > 0}; CPU, GPU and memory have keys of their own."""
    _check(isinstance(value, dict), f"{name} must be a mapping of custom resource -> amount, got {value!r}")
    for key, amount in value.items():
        _check(str(key) not in ("CPU", "GPU", "memory", "object_store_memory"),
               f"{name}: {key!r} is set by its own key (cpus/gpus per worker or actor); list custom "
               "resources only")
        ok = isinstance(amount, (int, float)) and not isinstance(amount, bool) and amount > 0
        _check(ok, f"{name}: {key}={amount!r} must be a number > 0")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"{name}={value!r} is not valid; choose one of {list(choices)}")


# ----------------------------------------------------------------------------- model


@dataclass
class BackboneConfig:
    """A frozen timm ViT. ``weights``: 'hub' (timm pretrained tag), 'none', or a file/URI."""

    name: str = "vit_small_patch16_224.augreg_in21k_ft_in1k"  # timm model name (a ViT), frozen
    weights: str = "hub"  # 'hub' (timm's pretrained download), 'none' (random), or a weights file/URI
    img_size: int = 224  # input side in pixels (position embeddings resampled to it)
    model_kwargs: dict = field(default_factory=dict)  # extra timm kwargs, e.g. {depth: 2} for tests

    def __post_init__(self) -> None:
        _check(bool(self.name), "model.backbone.name must name a timm ViT, e.g. vit_small_patch16_224")
        _check(bool(self.weights), "model.backbone.weights must be 'hub', 'none' or a file/URI")
        _check_range("model.backbone.img_size", self.img_size, 16, 1024)


@dataclass
class AdapterConfig:
    """Stochastic adapters (paper Eq. 4-5): two per block, rank r, keep probability p."""

    enabled: bool = True  # stochastic adapters beside the MSA and MLP of the chosen blocks
    rank: int = 128  # r, the adapter bottleneck width (W_down: D x r, W_up: r x D)
    keep_prob: float = 0.5  # p, Bernoulli keep probability per sample at training (1: static adapter)
    scale: float = 0.1  # fixed multiplier of the adapter output (Eq. 4)
    blocks: Optional[list[int]] = None  # adapted blocks: null = every block, else indices, e.g. [0, 1]
    layer_scale: bool = False  # adapter outputs through the block's LayerScale (no-op on ViTs without it)

    def __post_init__(self) -> None:
        _check_range("model.adapter.rank", self.rank, 1, 4096)
        _check(0.0 < self.keep_prob <= 1.0,
               f"model.adapter.keep_prob={self.keep_prob!r} is out of range; valid: 0 < p <= 1")
        if self.blocks is not None:
            _check(all(isinstance(b, int) and b >= 0 for b in self.blocks),
                   f"model.adapter.blocks={self.blocks!r}: expected a list of block indices >= 0")


PROMPT_POOL_INITS = ("random", "data")


@dataclass
class PromptPoolConfig:
    """Conditional prompt pool (paper Eq. 6-10): M prompts of Np tokens, keys and attention."""

    enabled: bool = True  # the conditional prompt pool, inserted after the CLS token
    pool_size: int = 20  # M, prompts in the pool
    length: int = 8  # Np, tokens per prompt
    ortho_weight: float = 1e-6  # lambda of the orthogonality penalty on keys, attention and prompts
    init: str = "random"  # random (the paper's orthogonal keys) | data: queries centred on a learned
    # centre c (D more parameters) and keys on their principal directions, both from the training images
    # before the first step (docs/recipe.md, "The prompt pool at this budget")

    def __post_init__(self) -> None:
        _check_choice("model.prompt_pool.init", self.init, PROMPT_POOL_INITS)
        _check_range("model.prompt_pool.pool_size", self.pool_size, 1, 4096)
        _check_range("model.prompt_pool.length", self.length, 1, 1024)
        _check(self.ortho_weight >= 0, "model.prompt_pool.ortho_weight must be >= 0")


@dataclass
class HeadConfig:
    """Linear(D -> embed_dim) on the final-norm CLS token, then L2 normalisation."""

    embed_dim: int = 128  # embedding size (the index dimension)
    init: str = "random"  # random (nn.Linear's) | pca: centred PCA of the initial training features

    def __post_init__(self) -> None:
        _check_range("model.head.embed_dim", self.embed_dim, 1, 65536)
        _check_choice("model.head.init", self.init, ("random", "pca"))


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


@dataclass
class ModelConfig:
    method: str = "puma"  # the method to train and embed with (puma.methods.METHODS), e.g. puma, linear
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    prompt_pool: PromptPoolConfig = field(default_factory=PromptPoolConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    vpt: VptConfig = field(default_factory=VptConfig)
    vptsp_g: VptspgConfig = field(default_factory=VptspgConfig)
    udml_ss: UdmlSsConfig = field(default_factory=UdmlSsConfig)

    def __post_init__(self) -> None:
        _check(bool(self.method), "model.method must be set, e.g. 'puma'")


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


# ----------------------------------------------------------------------------- data


@dataclass
class DataConfig:
    """Where prepared Parquet lives and how it is streamed."""

    uri: str = "artifacts/data/demo"  # prepared dataset root (local path or s3://)
    preset: str = "demo"  # how a missing data.uri is built: demo | cub | cars | ... ('' = never)
    source_root: str = "../shared/data"  # raw data: the demo's sample folders, or a named preset's release
    fashion_mnist_dir: str = "/usr/share/datasets/fashion-mnist"  # demo: Debian's Fashion-MNIST IDX files
    datasets: Optional[list[str]] = None  # datasets of the manifest to use; null: all of them
    val_fraction: float = 0.0  # fraction of training classes held out for validation (tune)
    shard_rows: int = 2000  # prepare: rows per Parquet shard (a shard also closes at 256 MiB of images)
    prepare_max_side: int = 0  # prepare: store images whose longer side exceeds this many px shrunk to it
    # (0: as encoded). Decoding a large photo then costs a small one's; about 2.3 x img_size (512 for 224
    # px) keeps the training crops' resolution. Must be >= the eval view's resize (256 for 224 px)
    max_images_per_class: Optional[int] = None  # demo: per-class cap of cub/flowers/omniglot (null: 12)
    fashion_mnist_per_class: int = 400  # demo: per-class cap of Fashion-MNIST, the large, dominant dataset
    num_decode_cpus: float = 1.0  # CPUs reserved per Ray Data read/decode task: 1 runs one task per CPU
    # (0.5 ran two per core and cut rows per core-second 2-4x, bench/results/data_decode_cpus_0.5.md);
    # below 1 only where Train workers must leave fractions of a CPU
    rejects_uri: str = ""  # where training lists rejected images (prepare's and decode's); ''
    # = <train.storage_path>/<train.run_name>/data_rejects.jsonl
    min_image_size: int = 16  # images whose shorter side is below this are rejected as tiny
    shuffle: str = "global"  # per-epoch shuffle: global (random_shuffle) | block (shard order and rows
    # within each read block, in the read task: no all-to-all, cheaper per core, but a block keeps its rows
    # every epoch: -0.023 harmonic R@1 on the demo's validation classes, docs/performance.md) | local (block
    # order and a consumer shuffle buffer) | none
    shuffle_buffer_rows: int = 1024  # local shuffle buffer for iter_batches consumers (shuffle=local)
    decode_batch_size: int = 128  # rows per Ray Data decode batch (and per embed-job decode task): each
    # output block costs the consumer and the executor a fixed share; 32 cost 20-25% more CPU per row on
    # CUB-sized photos (profiled: docs/performance.md)
    jpeg_draft: bool = True  # decode a JPEG at a reduced DCT scale (1/2, 1/4, 1/8) that still leaves the
    # pixels the view needs (eval: 256 px shorter side at 224; train: 2.6 x img_size): large photos decode
    # several times faster; at 224 px embeddings stay within cosine 0.9997 of a full-size decode
    crop_draft: bool = True  # with jpeg_draft: a training view decodes at the DCT scale of its own crop
    # (half the CPU for 1,000 px photos; pixels within 0.006-0.023 of a full-size decode's same crop)
    decode_on: str = "tasks"  # tasks: Ray Data tasks decode, crop and normalise (PIL) | worker: the tasks
    # read only plain JPEGs' headers and plan the crop; the consuming Train worker / embedding actor decodes
    # them on its device (nvjpeg on a GPU) and crops there; CPU cores per GPU drop to the header parsing
    shots_per_class: int = 0  # few-shot training: k training images per class (0: all), seeded, stable
    shots_seed: int = 0  # which k images (puma/data/fewshot.py): the same seed picks the same images
    deterministic: bool = False  # each worker gets the same rows in the same order on every run (Ray
    # Data preserve_order): multi-worker runs repeat exactly, wherever the workers are placed; a little slower

    def __post_init__(self) -> None:
        _check_range("data.val_fraction", self.val_fraction, 0.0, 0.9)
        _check(self.shard_rows >= 1, "data.shard_rows must be >= 1")
        _check(self.prepare_max_side >= 0, f"data.prepare_max_side={self.prepare_max_side!r} must be >= 0 "
                                           "(0: store images as encoded)")
        _check(self.num_decode_cpus > 0, f"data.num_decode_cpus={self.num_decode_cpus!r} must be > 0")
        _check(self.min_image_size >= 1, f"data.min_image_size={self.min_image_size!r} must be >= 1")
        _check_choice("data.shuffle", self.shuffle, ("global", "block", "local", "none"))
        _check_choice("data.decode_on", self.decode_on, ("tasks", "worker"))
        _check(self.decode_batch_size >= 1, "data.decode_batch_size must be >= 1")
        _check(self.shots_per_class >= 0, f"data.shots_per_class={self.shots_per_class!r} must be >= 0 "
                                         "(0: every training image)")
        _check(self.max_images_per_class is None or self.max_images_per_class >= 2,
               "data.max_images_per_class must be >= 2 (retrieval needs pairs) or null")
        _check(self.fashion_mnist_per_class >= 2, "data.fashion_mnist_per_class must be >= 2")


@dataclass
class RetryConfig:
    """puma.storage's one retry policy: transient S3 errors (connection refused or reset, timeouts,
    5xx, throttling) are retried; permanent ones (403, a missing bucket, a bad endpoint) are not."""

    max_attempts: int = 6  # attempts per storage call, the first included (1: never retry)
    initial_backoff_s: float = 0.25  # wait before the first retry; doubles each retry (with jitter)
    max_backoff_s: float = 4.0  # cap of one wait between attempts
    max_elapsed_s: float = 10.0  # no retry starts after this many seconds: how soon a dead endpoint
    # is reported; raise it to ride out longer outages

    def __post_init__(self) -> None:
        _check(self.max_attempts >= 1, f"storage.retry.max_attempts={self.max_attempts!r} must be >= 1 "
                                       "(1: never retry)")
        for name in ("initial_backoff_s", "max_backoff_s", "max_elapsed_s"):
            _check(getattr(self, name) >= 0, f"storage.retry.{name}={getattr(self, name)!r} must be >= 0")


@dataclass
class StorageConfig:
    """S3 settings; credentials come from the standard AWS chain, never from config."""

    endpoint_url: str = ""  # S3-compatible endpoint, e.g. http://127.0.0.1:8333 (SeaweedFS, MinIO);
    # '' = AWS_ENDPOINT_URL if set, else AWS S3
    region: str = ""  # AWS region of the buckets; '' = AWS_REGION or AWS_DEFAULT_REGION, else us-east-1
    connect_timeout_s: float = 3.0  # seconds to wait for a TCP connection to the endpoint
    retry: RetryConfig = field(default_factory=RetryConfig)

    def __post_init__(self) -> None:
        problem = storage.endpoint_problem(self.endpoint_url)
        _check(not problem, f"storage.endpoint_url={problem}")
        _check(self.connect_timeout_s > 0,
               f"storage.connect_timeout_s={self.connect_timeout_s!r} must be > 0")


# ----------------------------------------------------------------------------- training


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


# ----------------------------------------------------------------------------- index

INDEX_TYPES = ("auto", "flat", "ivf_flat", "ivf_pq")


@dataclass
class IndexConfig:
    """Sharded FAISS index (puma/index): type from size and memory budget, trained once, shared."""

    uri: str = "artifacts/index/demo"  # index folder (local path or s3://)
    index_type: str = "auto"  # auto | flat (exact) | ivf_flat | ivf_pq
    metric: str = "ip"  # ip (cosine on L2-normalised embeddings) | l2
    nlist: int = 0  # IVF lists; 0: auto, 4*sqrt(N) rounded to a power of 2, <= N/39
    pq_m: int = 0  # IVF-PQ bytes per code (sub-quantizers, divides E); 0: auto from the budget
    nprobe: int = 16  # IVF lists visited per query
    shard_size: int = 250_000  # items per shard
    memory_budget_gb: float = 8.0  # memory the whole index may take at search time (picks the type)
    flat_max_items: int = 200_000  # auto: exact search up to this many items
    train_sample: int = 0  # vectors used to train IVF; 0: auto, min(N, 64*nlist) and >= 39*nlist
    seed: int = 0  # seeds the IVF training sample and k-means
    use_gpu: bool = True  # FAISS GPUs for training and search when faiss.get_num_gpus() > 0
    query_chunk: int = 65536  # queries searched at once (bounds merge memory)
    compact_fraction: float = 0.2  # a shard whose removed rows reach this fraction is rewritten without them
    keep_versions: int = 3  # versions (one per model) kept at index.uri; the live and previous always are
    promote: str = "auto"  # auto: a new model's version goes live once it holds every live catalogue
    # and verifies; manual: only by `python jobs/index.py promote`
    on_disk: str = "auto"  # serving: IVF lists memory-mapped from a local file (FAISS on-disk lists, same
    # results): always | never | auto: when a replica's share of the index is estimated above
    # serve.index_replica_memory_gb (decided at service start; elsewhere above index.memory_budget_gb)
    cache_dir: str = ""  # serving: local folder for each replica's column files (hit fields and embeddings,
    # about the index's Parquet size uncompressed) and on-disk lists; '' = the system temp folder
    filter_cache_mb: float = 256.0  # serving: memory a replica may keep of repeated filters' selected
    # embeddings (selections small enough to scan exactly, at most 20 MB each), so their scans skip the
    # gather; 0: none kept

    def __post_init__(self) -> None:
        _check_choice("index.index_type", self.index_type, INDEX_TYPES)
        _check(0 < self.compact_fraction <= 1, f"index.compact_fraction={self.compact_fraction!r} must be in "
                                               "(0, 1] (1: only shards whose every row was removed)")
        _check(self.keep_versions >= 2, f"index.keep_versions={self.keep_versions!r} must be >= 2 (the live "
                                        "version and the one a rollback returns to)")
        _check_choice("index.promote", self.promote, ("auto", "manual"))
        _check_choice("index.on_disk", self.on_disk, ("auto", "always", "never"))
        _check_choice("index.metric", self.metric, ("ip", "l2"))
        _check(self.nlist >= 0, f"index.nlist={self.nlist!r} must be >= 0 (0: auto)")
        _check(self.pq_m >= 0, f"index.pq_m={self.pq_m!r} must be >= 0 (0: auto)")
        _check(self.nprobe >= 1, f"index.nprobe={self.nprobe!r} must be >= 1")
        _check(self.shard_size >= 1, f"index.shard_size={self.shard_size!r} must be >= 1")
        _check(self.memory_budget_gb > 0, f"index.memory_budget_gb={self.memory_budget_gb!r} must be > 0")
        _check(self.flat_max_items >= 0, "index.flat_max_items must be >= 0")
        _check(self.train_sample >= 0, f"index.train_sample={self.train_sample!r} must be >= 0 (0: auto)")
        _check(self.query_chunk >= 1, "index.query_chunk must be >= 1")
        _check(self.filter_cache_mb >= 0, f"index.filter_cache_mb={self.filter_cache_mb!r} must be >= 0 "
                                          "(0: none kept)")


# ----------------------------------------------------------------------------- batch embedding

EMBED_SPLITS = ("all", "train", "test")


@dataclass
class EmbedConfig:
    """Batch embedding of catalogues into the sharded index (jobs/embed.py, puma/inference).

    The model (architecture, img_size, normalisation) comes from the checkpoint's own config;
    the job config's ``model`` section is not used. A shard holds at most
    min(commit_rows, index.shard_size) items: each commit writes whole shards, manifest last.
    """

    checkpoint: str = ""  # checkpoint folder (local, s3://); '' = <train.storage_path>/<train.run_name>/best
    backbone_weights: str = ""  # where the frozen backbone comes from on the workers; '' = the checkpoint's
    batch_size: int = 64  # images per model forward in an actor
    concurrency: int = 1  # embedding actors (each loads the model once)
    num_cpus: float = 1.0  # CPUs reserved per actor (torch threads follow it); leave some for decoding
    num_gpus: float = 1.0  # GPUs per actor when GPUs are used
    use_gpu: bool = True  # run the actors on GPUs when the cluster has any (else on CPUs)
    split: str = "all"  # rows of a prepared dataset: all | train | test (image folders: always all)
    commit_rows: int = 50_000  # items per index commit: a crash loses at most this much work
    expected_items: int = 0  # size the index plan for this many items; 0: the first catalogue's size
    retry_rejects: bool = False  # re-try items listed in the catalogue's rejects file (default: skip them)
    runtime: str = "torch"  # torch | onnx: ONNX Runtime on CPU (the model exported once by the driver,
    # parity-checked: the index takes its vectors as the same model's)
    local_max_items: int = 256  # at most this many images to embed into an existing index: embedded in
    # the job's own process with the model it loads anyway (no Ray Data pipeline to start); 0: never
    actor_resources: dict = field(default_factory=dict)  # custom Ray resources per embedding actor, e.g.
    # {embed_slot: 1} with one slot per node: one actor per node
    stamp_column: str = ""  # a table catalogue's column that changes whenever a row's image does (an ETag,
    # a version id, updated_at): the image's stamp, no storage request; '' (or an empty cell) = the image's
    # size and write time from its store. Switching it reads every image once to compare

    def __post_init__(self) -> None:
        _check_custom_resources("embed.actor_resources", self.actor_resources)
        _check(self.batch_size >= 1, f"embed.batch_size={self.batch_size!r} must be >= 1")
        _check(self.concurrency >= 1, f"embed.concurrency={self.concurrency!r} must be >= 1 actor")
        _check(self.num_cpus > 0, f"embed.num_cpus={self.num_cpus!r} must be > 0")
        _check(self.num_gpus > 0, f"embed.num_gpus={self.num_gpus!r} must be > 0 (use embed.use_gpu=false "
                                  "to run on CPUs)")
        _check_choice("embed.split", self.split, EMBED_SPLITS)
        _check(self.commit_rows >= 1, f"embed.commit_rows={self.commit_rows!r} must be >= 1")
        _check(self.local_max_items >= 0, f"embed.local_max_items={self.local_max_items!r} must be >= 0")
        _check_choice("embed.runtime", self.runtime, ("torch", "onnx"))
        _check(self.expected_items >= 0, f"embed.expected_items={self.expected_items!r} must be >= 0 "
                                         "(0: the first catalogue's size)")


# ----------------------------------------------------------------------------- online search

SERVE_GPU_MODES = ("auto", "always", "never")


@dataclass
class ServeConfig:
    """The online search service (jobs/serve.py, puma/serve): Ray Serve over the index at index.uri.

    Image queries are embedded by the checkpoint the index was built with (embed.checkpoint, '' =
    <train.storage_path>/<train.run_name>/best); its model id must equal the index's. Replicas of
    the model and index deployments autoscale between their min and max on ongoing requests.
    """

    host: str = "127.0.0.1"  # where the service listens (0.0.0.0 inside a pod)
    port: int = 8000  # the HTTP port (the page at /, POST /search) on every node with an ingress replica
    ingress: str = "direct"  # direct: each ingress replica listens on serve.port itself (Ray Serve's direct
    # ingress, one per node; no proxy hop) | proxy: Serve's HTTP proxy on every node forwards to it
    app_name: str = "puma-search"  # the Serve application's name (serve status, the RayService)
    image_queries: bool = True  # false: no model deployment; vector and item-id queries only
    default_k: int = 10  # hits when a request names no k
    max_k: int = 100  # the largest k a request may ask for
    max_upload_bytes: int = 10 * 1024 * 1024  # request bodies above this get 413
    max_image_pixels: int = 40_000_000  # images of more pixels (width x height) get 413
    max_batch_size: int = 16  # query images embedded in one forward (@serve.batch)
    batch_wait_timeout_s: float = 0.005  # how long a batch waits to fill
    gpu: str = "auto"  # auto: GPUs when the cluster has some at start | always | never
    model_min_replicas: int = 1  # the model deployment (image queries) scales between these
    model_max_replicas: int = 2  # at most this many model replicas
    model_num_cpus: float = 1.0  # CPUs per model replica (torch threads follow it)
    model_num_gpus: float = 1.0  # GPUs per model replica when GPUs are used
    index_partitions: int = 1  # 1: each ingress replica holds the whole index (no hop for vector and item
    # queries) | N > 1: N index deployments, each holding 1/N of the shards; queries fan out, top-k merged
    # exactly | 0: the plan picks N from the index's size and serve.index_replica_memory_gb
    index_replica_memory_gb: float = 8.0  # memory one replica may give the index (serve.index_partitions=0)
    index_min_replicas: int = 1  # each index partition (serve.index_partitions > 1) scales between these
    index_max_replicas: int = 2  # at most this many replicas per partition
    index_num_cpus: float = 1.0  # CPUs per index partition replica
    index_num_gpus: float = 0.5  # GPUs per index partition replica when GPUs are used (faiss-gpu)
    index_resources: dict = field(default_factory=dict)  # custom Ray resources per partition replica, e.g.
    # {index_slot: 1} with one slot per node: partitions spread over nodes, one per node
    partition_timeout_s: float = 5.0  # a partition that does not answer within this: the query gets 503
    partition_channel: str = "direct"  # how a query reaches the partitions: direct: each partition replica's
    # own TCP channel (puma.serve.channel: ~0.5 ms a fan-out) | ray: Ray Serve handle calls (~3-7 ms more
    # a query; for networks that open only Ray's ports between nodes)
    ingress_replicas: int = 1  # replicas of the HTTP ingress (requests, the page; the index when not
    # partitioned); with serve.ingress=direct at most one per node: one per node you want to answer
    ingress_num_cpus: float = 0.5  # the HTTP ingress also decodes query images
    ingress_resources: dict = field(default_factory=dict)  # custom Ray resources per ingress replica (e.g.
    # to keep it on the nodes a load balancer reaches)
    max_ongoing_requests: int = 64  # requests one ingress replica works on at once
    max_queued_requests: int = 256  # more waiting than this: 503 with Retry-After at once (-1: no bound)
    retry_after_s: float = 1.0  # the Retry-After of those 503s
    target_ongoing_requests: float = 4.0  # index autoscaling: requests per replica (model: max_batch_size)
    watch_interval_s: float = 10.0  # how often replicas look for new shards and a new live version
    version_grace_s: float = 30.0  # a replaced version stays loaded this long (and while requests hold it)
    runtime: str = "torch"  # the query model: torch | onnx (ONNX Runtime on CPU, parity-checked at load)
    token_env: str = "PUMA_SERVE_TOKEN"  # a non-empty value there requires `Authorization: Bearer <it>`
    access_log: bool = False  # one log line per request in the replicas' logs
    metrics: bool = True  # the service's own metrics (puma/serve/metrics.py); false: none recorded
    metrics_port: int = 0  # a local Ray's metrics port for Prometheus (Ray's, Serve's and the service's
    # metrics: puma/serve/metrics.py; 0: a free one, printed at start); on a cluster each node's own
    # (ray start --metrics-export-port)

    def __post_init__(self) -> None:
        _check(bool(self.host), "serve.host must be an address to listen on, e.g. 127.0.0.1 or 0.0.0.0")
        _check_range("serve.port", self.port, 1, 65535)
        _check(bool(self.app_name), "serve.app_name must be set, e.g. puma-search")
        _check_range("serve.max_k", self.max_k, 1, 10_000)
        _check_range("serve.default_k", self.default_k, 1, self.max_k)
        _check(self.max_upload_bytes >= 1024, "serve.max_upload_bytes must be >= 1024")
        _check(self.max_image_pixels >= 256, "serve.max_image_pixels must be >= 256")
        _check_range("serve.max_batch_size", self.max_batch_size, 1, 4096)
        _check_range("serve.batch_wait_timeout_s", self.batch_wait_timeout_s, 0.0, 10.0)
        _check_choice("serve.gpu", self.gpu, SERVE_GPU_MODES)
        for part in ("model", "index"):
            low, high = getattr(self, f"{part}_min_replicas"), getattr(self, f"{part}_max_replicas")
            _check(1 <= low <= high, f"serve.{part}_min_replicas={low} and serve.{part}_max_replicas={high}: "
                                     "need 1 <= min <= max")
        for name in ("model_num_cpus", "index_num_cpus", "ingress_num_cpus"):
            _check(getattr(self, name) > 0, f"serve.{name}={getattr(self, name)!r} must be > 0")
        for name in ("model_num_gpus", "index_num_gpus"):
            _check(getattr(self, name) >= 0, f"serve.{name}={getattr(self, name)!r} must be >= 0")
        _check(self.ingress_replicas >= 1, "serve.ingress_replicas must be >= 1")
        _check_choice("serve.ingress", self.ingress, ("direct", "proxy"))
        _check(self.index_partitions >= 0, f"serve.index_partitions={self.index_partitions!r} must be >= 0 "
                                           "(0: picked from the index size)")
        _check(self.index_replica_memory_gb > 0, "serve.index_replica_memory_gb must be > 0")
        _check(self.max_ongoing_requests >= 1, "serve.max_ongoing_requests must be >= 1")
        _check(self.max_queued_requests == -1 or self.max_queued_requests >= 1,
               "serve.max_queued_requests must be >= 1 (or -1: no bound)")
        _check(self.retry_after_s >= 0, "serve.retry_after_s must be >= 0 seconds")
        _check(self.partition_timeout_s > 0, "serve.partition_timeout_s must be > 0 seconds")
        _check_choice("serve.partition_channel", self.partition_channel, ("direct", "ray"))
        _check_custom_resources("serve.index_resources", self.index_resources)
        _check_custom_resources("serve.ingress_resources", self.ingress_resources)
        _check(self.target_ongoing_requests > 0, "serve.target_ongoing_requests must be > 0")
        _check(self.watch_interval_s > 0, "serve.watch_interval_s must be > 0 seconds")
        _check(self.version_grace_s >= 0, "serve.version_grace_s must be >= 0 seconds")
        _check_choice("serve.runtime", self.runtime, ("torch", "onnx"))


# ----------------------------------------------------------------------------- sweep


@dataclass
class SweepConfig:
    """Ray Tune sweep (tune/sweep.py): Optuna TPE search, ASHA early stopping, per-trial resources.

    Trials train on the training classes minus ``val_fraction`` of them and are scored on those
    held-out classes (``train.eval_split=val``); the test split is never used for selection.
    """

    name: str = "sweep"  # the sweep lives at <storage_path>/<name>; re-running the same name resumes it
    storage_path: str = ""  # local or s3:// (shared storage on a cluster); '' = <train.storage_path>/sweeps
    space_file: str = ""  # search-space YAML of dotted config keys; '' = tune/search_space.yaml
    num_samples: int = 8  # trials to run
    max_concurrent_trials: int = 1  # trials running at once
    metric: str = "harmonic/r@1"  # the objective, a validation metric reported every epoch
    mode: str = "max"  # whether sweep.metric is maximised or minimised: max | min
    seed: int = 0  # Optuna TPE sampler seed
    grace_period: int = 1  # ASHA: epochs every trial runs before it may be stopped
    reduction_factor: int = 2  # ASHA: keep the top 1/reduction_factor at each rung
    cpus_per_trial: float = 0.25  # CPUs of each trial's driver (its workers take train.cpus_per_worker)
    val_fraction: float = 0.2  # training classes held out for the objective (data.val_fraction in trials)
    resume: bool = True  # an existing sweep of the same name: resume it (false: refuse to touch it)

    def __post_init__(self) -> None:
        _check(bool(self.name) and "/" not in self.name, f"sweep.name={self.name!r} must be a non-empty "
                                                         "folder name without '/'")
        _check(self.num_samples >= 1, f"sweep.num_samples={self.num_samples!r} must be >= 1")
        _check(self.max_concurrent_trials >= 1, "sweep.max_concurrent_trials must be >= 1")
        _check(bool(self.metric), "sweep.metric must name a reported metric, e.g. harmonic/r@1")
        _check_choice("sweep.mode", self.mode, ("max", "min"))
        _check(self.grace_period >= 1, f"sweep.grace_period={self.grace_period!r} must be >= 1 epoch")
        _check(self.reduction_factor >= 2, f"sweep.reduction_factor={self.reduction_factor!r} must be >= 2")
        _check(self.cpus_per_trial > 0, f"sweep.cpus_per_trial={self.cpus_per_trial!r} must be > 0")
        _check(0.0 < self.val_fraction <= 0.9,
               f"sweep.val_fraction={self.val_fraction!r} is out of range; valid: 0 < val_fraction <= 0.9")


# ----------------------------------------------------------------------------- metrics


@dataclass
class MetricsConfig:
    """Jobs' figures for Prometheus (puma/job_metrics.py); the service's are ``serve.metrics``."""

    pushgateway: str = ""  # a Prometheus Pushgateway (http://host:9091) the jobs push their figures to: the
    # embedding job each catalogue's counts, training each epoch's, a sweep its trials'; '' = none pushed
    push_timeout_s: float = 5.0  # a push that takes longer is given up (a warning; the job goes on)

    def __post_init__(self) -> None:
        _check(not self.pushgateway or self.pushgateway.startswith(("http://", "https://")),
               f"metrics.pushgateway={self.pushgateway!r} must be an http(s):// URL, e.g. "
               "http://prometheus-pushgateway.monitoring:9091, or '' for none")
        _check(self.push_timeout_s > 0, f"metrics.push_timeout_s={self.push_timeout_s!r} must be > 0")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    embed: EmbedConfig = field(default_factory=EmbedConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


# ----------------------------------------------------------------------------- machinery


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; int -> float is the only widening."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(key, value, args[0])
    if origin is list:
        _check(isinstance(value, (list, tuple)), f"{key}: expected a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        _check(isinstance(value, dict), f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if _is_dataclass_type(tp):
        _check(isinstance(value, dict), f"{key}: expected a mapping, got {value!r}")
        return _from_dict(tp, value, key)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _looks_numeric(value):
        return float(value)  # YAML 1.1 reads 1.0e4 (no exponent sign) as a string
    if tp is bool:
        _check(isinstance(value, bool), f"{key}: expected true/false, got {value!r}")
        return value
    if tp in (int, float, str):
        ok = isinstance(value, tp) and not (tp is int and isinstance(value, bool))
        _check(ok, f"{key}: expected {tp.__name__}, got {value!r} ({type(value).__name__})")
        return value
    return value


def _from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    where = prefix or "config"
    valid = sorted(_join(prefix, k) for k in types_)
    _check(not unknown, f"unknown key(s) {[_join(prefix, u) for u in unknown]} in {where}"
                        f"{_did_you_mean(_join(prefix, unknown[0]), valid) if unknown else ''}; "
                        f"valid keys: {valid}")
    kwargs = {k: _coerce(_join(prefix, k), v, types_[k]) for k, v in data.items()}
    return cls(**kwargs)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def to_dict(cfg: Any) -> dict:
    """The config as plain nested dicts (YAML/JSON serialisable)."""
    return dataclasses.asdict(cfg)


def from_dict(data: dict, cls: type = Config) -> Any:
    """Build and validate a config from nested dicts; unknown keys are errors (renamed ones move)."""
    return _from_dict(cls, _upgrade(data) if cls is Config else data)


def valid_keys(cls: type = Config, prefix: str = "") -> dict[str, Any]:
    """Every dotted leaf key of ``cls`` with its annotation."""
    out: dict[str, Any] = {}
    for name, tp in _field_types(cls).items():
        key = _join(prefix, name)
        if _is_dataclass_type(tp):
            out.update(valid_keys(tp, key))
        else:
            out[key] = tp
    return out


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's description, from the source: the comment ending its line, continued by comment
    lines right below it (so ``--help-config`` cannot drift from the code)."""
    source = inspect.getsource(cls)
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    comments = {t.start[0]: t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT}
    lines = source.splitlines()
    docs = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            parts = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
            below = node.end_lineno + 1
            while below <= len(lines) and lines[below - 1].strip().startswith("#"):
                parts.append(comments[below])
                below += 1
            docs[node.target.id] = " ".join(parts)
    return docs


def describe_keys(cls: type = Config, prefix: str = "",
                  defaults: Any = None) -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) of every leaf key, in declaration order."""
    defaults = cls() if defaults is None else defaults
    out = []
    docs = field_docs(cls)
    for name, tp in _field_types(cls).items():
        key, value = _join(prefix, name), getattr(defaults, name)
        if _is_dataclass_type(tp):
            out += describe_keys(tp, key, value)
        else:
            out.append((key, _type_name(tp), _show(value), docs.get(name, "")))
    return out


def help_config_lines() -> list[str]:
    """``--help-config``: one line per key with its type, default and description."""
    return [f"{key} ({tp}, default {default}): {doc}" for key, tp, default, doc in describe_keys()]


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp)).replace("NoneType", "null")
    return tp.__name__ if isinstance(tp, type) and not typing.get_args(tp) else str(tp).replace("typing.", "")


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else json.dumps(value)


# Keys renamed since configs were first saved (checkpoints keep theirs): old key -> (new key, convert).
RENAMED_KEYS: dict[str, tuple[str, Any]] = {
    "storage.retries": ("storage.retry.max_attempts", lambda retries: int(retries) + 1),
}


def _upgrade(data: dict | None) -> dict | None:
    """A copy of nested config dicts with renamed keys moved to their new names."""
    if not data:
        return data
    data = copy.deepcopy(data)
    for old, (new, convert) in RENAMED_KEYS.items():
        *parents, leaf = old.split(".")
        node = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            value = convert(node.pop(leaf))
            *new_parents, new_leaf = new.split(".")
            target = data
            for part in new_parents:
                target = target.setdefault(part, {})
            target.setdefault(new_leaf, value)
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``a.b.c=value``; the value is read as YAML (``1e-4``, ``[1,2]``, ``true``)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key=value, e.g. train.epochs=5")
    key, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else ""
    if isinstance(value, str) and _looks_numeric(value):
        value = float(value)
    return key.strip(), value


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def set_dotted(data: dict, key: str, value: Any) -> None:
    """Set ``data[a][b][c] = value`` for ``key='a.b.c'``; the key must exist in Config."""
    keys = valid_keys()
    if key not in keys:
        raise ConfigError(f"unknown config key {key!r}{_did_you_mean(key, keys)}; --help-config lists "
                          "every key")
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _did_you_mean(key: str, valid: typing.Iterable[str]) -> str:
    """`` (did you mean 'train.epochs'?)`` naming the closest valid keys (difflib); '' when none is close.

    Keys with the same last part win (``epochs`` -> ``train.epochs``), else keys of the same section
    spelled alike in their last part (``train.epoch``), else keys spelled alike as a whole.
    """
    valid = sorted(valid)
    leaf = key.rsplit(".", 1)[-1]
    section = key.rpartition(".")[0]
    same_leaf = [k for k in valid if k.rsplit(".", 1)[-1] == leaf]
    whole = difflib.get_close_matches(key, valid, n=3, cutoff=0.75)
    siblings = {k.rsplit(".", 1)[-1]: k for k in valid if k.rpartition(".")[0] == section}
    by_leaf = [siblings[m] for m in difflib.get_close_matches(leaf, list(siblings), n=3, cutoff=0.6)]
    close = (same_leaf or by_leaf or whole)[:3]
    return f" (did you mean {' or '.join(repr(k) for k in close)}?)" if close else ""


def _section_keys(prefix: str, section: dict) -> list[str]:
    """Dotted names of a config section's keys (YAML merge: what a misspelt key may have meant)."""
    return [_join(prefix, k) for k in section]


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict | None = None) -> Config:
    """Defaults, then ``base`` (dict), then the YAML at ``path``, then dotted ``overrides``."""
    data = to_dict(Config())
    for layer in (base, _read_yaml(path) if path else None):
        if layer:
            _merge(data, _upgrade(layer))
    for text in overrides or []:
        key, value = parse_override(text)
        if key in RENAMED_KEYS:
            key, value = RENAMED_KEYS[key][0], RENAMED_KEYS[key][1](value)
        set_dotted(data, key, value)
    return from_dict(data)


def _read_yaml(path: str | Path) -> dict:
    text = storage.read_text(str(path))
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(exc).split())}") from exc
    _check(isinstance(data, dict), f"config file {path}: expected a mapping at the top level")
    return data


def _merge(dst: dict, src: dict, prefix: str = "") -> None:
    leaves = valid_keys()
    for key, value in src.items():
        full = _join(prefix, key)
        if isinstance(value, dict) and isinstance(dst.get(key), dict) and full not in leaves:
            _merge(dst[key], value, full)
        else:
            hint = _did_you_mean(full, _section_keys(prefix, dst))
            _check(key in dst, f"unknown config key {full!r}{hint}; valid keys: {sorted(dst)}")
            dst[key] = value


def dump_yaml(cfg: Any) -> str:
    """The resolved config as YAML text (saved beside every artifact)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


# Config keys that hold local-or-remote locations; relative local paths are made absolute at the
# driver, because Ray workers run in other directories.
PATH_KEYS = ("model.backbone.weights", "data.uri", "data.source_root", "data.fashion_mnist_dir",
             "data.rejects_uri", "train.storage_path", "index.uri",
             "sweep.storage_path", "sweep.space_file", "embed.checkpoint", "embed.backbone_weights")
NOT_PATHS = ("", "hub", "none")


def absolute_paths(cfg: Config, base: str | Path | None = None) -> Config:
    """A copy of ``cfg`` whose relative local paths (see PATH_KEYS) are absolute, from ``base``."""
    data = to_dict(cfg)
    root = Path(base or Path.cwd())
    for key in PATH_KEYS:
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.get(part, {})
        value = node.get(leaf) if isinstance(node, dict) else None
        if isinstance(value, str) and value not in NOT_PATHS and "://" not in value \
                and not Path(value).is_absolute():
            node[leaf] = str((root / value).resolve())
    return from_dict(data)
