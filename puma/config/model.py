"""``model``: the frozen backbone and what PUMA adds to it (adapters, prompt pool, head).

``ModelConfig`` also holds the sections of the other methods (``puma.config.methods``); which
sections a method reads is its record's business (``puma.methods``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from puma.config.checks import _check, _check_choice, _check_range
from puma.config.methods import LoraConfig, UdmlSsConfig, VptConfig, VptspgConfig


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
