"""Typed, layered configuration: defaults -> YAML file -> dotted ``key=value`` overrides.

Every section is a dataclass that validates itself in ``__post_init__``. The same dotted
keys are used by ``jobs/*.py`` overrides and by ``tune/`` search spaces, so a key that is
not a field here is an error everywhere.

Modules, one per concern (each section's checks live with it):

- ``checks``: ``ConfigError`` and the checks the sections run.
- ``model``: ``model`` and its backbone, adapter, prompt_pool and head sections.
- ``methods``: the other methods' sections, ``model.lora``, ``model.vpt``, ``model.vptsp_g``,
  ``model.udml_ss``.
- ``train``: ``loss``, ``optim``, ``train``, ``eval``.
- ``data``: ``data`` and ``storage`` (with ``storage.retry``).
- ``index``: ``index`` and ``embed`` (the batch embedding job).
- ``serve``, ``sweep``, ``metrics``: the search service, the Ray Tune sweep, the jobs' metrics.
- ``loader``: ``Config`` and the machinery: dicts and YAML in and out, overrides, renamed keys, paths.
- ``describe``: each key's type, default and description (``--help-config``, the config reference).

Every name is re-exported here: callers import from ``puma.config``.
"""

from puma.config.checks import ConfigError
from puma.config.data import DataConfig, RetryConfig, StorageConfig
from puma.config.describe import describe_keys, field_docs, help_config_lines
from puma.config.index import EMBED_SPLITS, INDEX_TYPES, EmbedConfig, IndexConfig
from puma.config.loader import (
    NOT_PATHS,
    PATH_KEYS,
    RENAMED_KEYS,
    Config,
    absolute_paths,
    dump_yaml,
    for_this_process,
    from_dict,
    load_config,
    parse_override,
    set_dotted,
    to_dict,
    valid_keys,
)
from puma.config.loader import _field_types as _field_types  # scripts/docs_hooks.py walks the sections
from puma.config.loader import _is_dataclass_type as _is_dataclass_type
from puma.config.methods import LORA_TARGETS, VPTSP_FUSIONS, LoraConfig, UdmlSsConfig, VptConfig, VptspgConfig
from puma.config.metrics import MetricsConfig
from puma.config.model import (
    PROMPT_POOL_INITS,
    AdapterConfig,
    BackboneConfig,
    HeadConfig,
    ModelConfig,
    PromptPoolConfig,
)
from puma.config.serve import SERVE_GPU_MODES, ServeConfig
from puma.config.sweep import SweepConfig
from puma.config.train import (
    LOSS_NAMES,
    ONE_PROXY_PER_CLASS,
    PLACEMENT_STRATEGIES,
    EvalConfig,
    LossConfig,
    OptimConfig,
    TrainConfig,
)

__all__ = [
    "EMBED_SPLITS", "INDEX_TYPES", "LORA_TARGETS", "LOSS_NAMES", "NOT_PATHS", "ONE_PROXY_PER_CLASS",
    "PATH_KEYS", "PLACEMENT_STRATEGIES", "PROMPT_POOL_INITS", "RENAMED_KEYS", "SERVE_GPU_MODES",
    "VPTSP_FUSIONS", "AdapterConfig", "BackboneConfig", "Config", "ConfigError", "DataConfig",
    "EmbedConfig", "EvalConfig", "HeadConfig", "IndexConfig", "LoraConfig", "LossConfig", "MetricsConfig",
    "ModelConfig", "OptimConfig", "PromptPoolConfig", "RetryConfig", "ServeConfig", "StorageConfig",
    "SweepConfig", "TrainConfig", "UdmlSsConfig", "VptConfig", "VptspgConfig", "absolute_paths",
    "describe_keys", "dump_yaml", "field_docs", "for_this_process", "from_dict", "help_config_lines",
    "load_config",
    "parse_override", "set_dotted", "to_dict", "valid_keys",
]
