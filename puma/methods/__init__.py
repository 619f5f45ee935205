"""The methods, selectable by ``model.method``: one record per file, collected in one registry here.

Every method is a frozen timm ViT (final-norm CLS token) plus a 128-d L2-normalised head; they
differ in what is added to the backbone, what trains and how a step trains it:

==============  ================================================  ================================
method          architecture (config sections it reads)            trains
==============  ================================================  ================================
puma            stochastic adapters + prompt pool, as enabled      adapters, prompt pool, head
                (adapter, prompt_pool)
linear          frozen backbone + Linear head (Linear Emb.)        head
mlp3            frozen backbone + 3-layer MLP head (MLP-3 Emb.)    head
vpt_shallow     Np prompt tokens at the input (vpt)                prompts, head
vpt_deep        Np fresh prompt tokens before every block (vpt)    prompts, head
lora            LoRA on the attention projections (lora)           LoRA branches, head
puma_lora       PUMA + LoRA (adapter, prompt_pool, lora)           adapters, pool, LoRA, head
adaptformer     PUMA's adapters with keep_prob = 1, no prompt      adapters, head
                pool (adapter: rank, scale, blocks)
bitfit          frozen backbone, bias terms unfrozen               backbone biases, head
full_finetune   the whole backbone trains (Table 2(a), 2(b))       every parameter
vptsp_g         VPTSP-G (ICLR 2024): deep visual prompts; class    prompts, proxy head, GRU,
                prompts -> semantic proxies (vptsp_g)              head, class prompts (bank),
                                                                   backbone biases (bitfit)
udml_ss         UDML-SS: PUMA's adaptation + rotation head,        adapters, pool, head,
                k-means pseudo-labels (udml_ss)                    rotation head
==============  ================================================  ================================

A method ignores the sections it does not read (``linear`` builds no adapters whatever
``model.adapter.enabled`` says). What a record holds: puma/methods/method.py. Adding a method is
adding its file (a :class:`Method` record) and listing the record in ``METHODS`` below.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from puma import config
from puma.config import Config, ConfigError, ModelConfig
from puma.data.images import check_prepare_max_side
from puma.methods.adaptformer import ADAPTFORMER
from puma.methods.bitfit import BITFIT
from puma.methods.full_finetune import FULL_FINETUNE
from puma.methods.linear import LINEAR
from puma.methods.lora import LORA
from puma.methods.method import Method, Training, TrainModule
from puma.methods.mlp3 import MLP3
from puma.methods.puma import PUMA
from puma.methods.puma_lora import PUMA_LORA
from puma.methods.udml_ss import UDML_SS
from puma.methods.vpt_deep import VPT_DEEP
from puma.methods.vpt_shallow import VPT_SHALLOW
from puma.methods.vptsp_g import VPTSP_G
from puma.models.puma_model import PumaModel
from puma.models.trainable import set_trainable

METHODS: Mapping[str, Method] = MappingProxyType({m.name: m for m in (
    PUMA, LINEAR, MLP3, VPT_SHALLOW, VPT_DEEP, LORA, PUMA_LORA, ADAPTFORMER, BITFIT, FULL_FINETUNE,
    VPTSP_G, UDML_SS,
)})
# Read-only view derived from the records: the parts each method declares (before its options).
METHOD_TRAINABLE: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {name: m.trainable for name, m in METHODS.items()})

__all__ = ["METHODS", "METHOD_TRAINABLE", "Method", "TrainModule", "Training", "build_method_training",
           "build_model", "build_train_module", "check_config", "get_method", "load_config",
           "mark_trainable", "needs_labels"]


def get_method(name: str) -> Method:
    """The record of ``model.method=name``; raises ConfigError listing the registered methods."""
    if name not in METHODS:
        raise ConfigError(f"model.method={name!r} is not known; valid: {sorted(METHODS)}")
    return METHODS[name]


def build_model(cfg: ModelConfig) -> PumaModel:
    """The model of ``cfg.method``, with exactly its declared parts trainable (:func:`mark_trainable`)."""
    model = get_method(cfg.method).build(cfg)
    model.method = cfg.method
    mark_trainable(model)
    return model


def mark_trainable(model: PumaModel) -> None:
    """Freeze everything, then unfreeze exactly the parts ``model.method`` (and its options) declare."""
    if model.method not in METHODS:
        raise ConfigError(f"model.method={model.method!r} declares no trainable set: no record in "
                          f"puma.methods.METHODS; registered: {sorted(METHODS)}")
    set_trainable(model, METHODS[model.method].parts(model))


def build_train_module(cfg: Config, model: PumaModel, num_classes: int) -> TrainModule:
    """``cfg.model.method``'s train module (its loss wiring) for ``model`` and ``num_classes`` classes."""
    return get_method(cfg.model.method).train_module(cfg, model, num_classes)


def build_method_training(cfg: Config, model: PumaModel, num_classes: int) -> Training:
    """What the worker loop runs: the method's train module, label source and epoch hook."""
    method = get_method(cfg.model.method)
    return method.training(cfg, method.train_module(cfg, model, num_classes))


def needs_labels(method: str) -> bool:
    """Whether ``method`` trains on the data's labels (False: it makes its own, e.g. udml_ss)."""
    return get_method(method).needs_labels


def check_config(cfg: Config) -> None:
    """Raise ConfigError (one line) when ``cfg.model.method`` is unknown or cannot train with ``cfg``, or
    the data settings cannot feed its model (each rule lives in its own layer)."""
    check_prepare_max_side(cfg.data.prepare_max_side, cfg.model.backbone.img_size)
    get_method(cfg.model.method).check_config(cfg)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict | None = None) -> Config:
    """``puma.config.load_config``, then the checks of ``model.method``'s record (what every job's
    command line loads); an unknown method is left to the code that builds a model, which refuses it."""
    cfg = config.load_config(path, overrides, base)
    check_prepare_max_side(cfg.data.prepare_max_side, cfg.model.backbone.img_size)
    if cfg.model.method in METHODS:
        get_method(cfg.model.method).check_config(cfg)
    return cfg
