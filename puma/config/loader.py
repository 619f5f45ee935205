"""The whole config and how it is read: defaults -> ``base`` dict -> YAML file -> dotted overrides.

Owns ``Config`` (one field per section), nested dicts to and from dataclasses (types checked,
unknown keys named with the closest valid one, renamed keys moved), ``key=value`` overrides,
YAML in and out, and the keys that hold paths (made absolute at the driver).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from puma import storage
from puma.config.checks import ConfigError, _check
from puma.config.data import DataConfig, StorageConfig
from puma.config.index import EmbedConfig, IndexConfig
from puma.config.metrics import MetricsConfig
from puma.config.model import ModelConfig
from puma.config.serve import ServeConfig
from puma.config.sweep import SweepConfig
from puma.config.train import EvalConfig, LossConfig, OptimConfig, TrainConfig


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


def for_this_process(cfg: Config) -> Config:
    """The config as this process works with it: its relative local paths made absolute (from the
    working directory: Ray workers run in other ones) and storage configured with its settings.

    A job's entry point calls it once (``puma.cli.parse_job_args``); the library functions a job calls,
    which a test or a notebook may call directly, call it on what they are given: on a config it has
    already returned it changes nothing, and storage is configured again only if the settings differ."""
    cfg = absolute_paths(cfg)
    storage.configure_once(cfg.storage)
    return cfg
