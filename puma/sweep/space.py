"""The search space: a YAML file of dotted config keys -> distributions, checked against Config.

Format (``tune/search_space.yaml``)::

    model.adapter.rank: {type: choice, values: [32, 64, 128]}
    model.adapter.keep_prob: {type: uniform, low: 0.3, high: 1.0}
    model.prompt_pool.pool_size: {type: randint, low: 5, high: 30}     # both ends inclusive
    optim.lr: {type: loguniform, low: 1.0e-5, high: 1.0e-3}

or a grid, every combination tried once (Optuna's GridSampler instead of TPE; a grid cannot be
mixed with sampled entries, and sweep.num_samples must equal the number of combinations)::

    optim.lr: {type: grid, values: [3.0e-5, 1.0e-4, 3.0e-4]}

Keys are the same dotted keys as ``jobs/train.py`` overrides, so a key that is not a config field
is an error. Each distribution is checked on its own (types, low < high, loguniform low > 0), then
every value it can reach at its bounds (each choice; low and high of a range) is built into a
real Config from the base config, so a range the config would reject fails here, before any trial.
No Ray in this module.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import yaml

from puma import storage
from puma.config import Config, ConfigError, from_dict, set_dotted, to_dict, valid_keys

KINDS = ("choice", "uniform", "loguniform", "randint", "grid")
LISTED = ("choice", "grid")  # kinds that take ``values``
# Keys each trial sets itself (where it writes, what it evaluates): a space may not tune them.
SWEEP_OWNED = ("train.run_name", "train.storage_path", "train.eval_split", "train.eval_every",
               "train.best_metric", "data.val_fraction")


class SearchSpaceError(ConfigError):
    """The search space names an unknown key or a distribution the config cannot accept."""


@dataclass(frozen=True)
class ParamSpec:
    """One tuned config key: ``kind`` with ``values`` (choice) or ``low``/``high`` (ranges)."""

    key: str
    kind: str
    low: float | int | None = None
    high: float | int | None = None
    values: tuple = ()

    def bounds(self) -> list[tuple[str, Any]]:
        """(label, value) of every extreme value this distribution can produce."""
        if self.kind in LISTED:
            return [(f"values[{i}]", v) for i, v in enumerate(self.values)]
        return [("low", self.low), ("high", self.high)]

    def to_dict(self) -> dict:
        """The YAML form of this entry."""
        if self.kind in LISTED:
            return {"type": self.kind, "values": list(self.values)}
        return {"type": self.kind, "low": self.low, "high": self.high}


SearchSpace = dict[str, ParamSpec]


def read_space(uri: str) -> SearchSpace:
    """Parse and check (without a base config) the search-space YAML at ``uri``."""
    try:
        data = yaml.safe_load(storage.read_text(uri))
    except FileNotFoundError as exc:
        raise SearchSpaceError(f"search-space file {uri} not found") from exc
    return parse_space(data, source=uri)


def parse_space(data: Any, source: str = "search space") -> SearchSpace:
    """A SearchSpace from ``{dotted.key: {type: ..., ...}}``; unknown keys and bad entries raise."""
    if not isinstance(data, dict) or not data:
        raise SearchSpaceError(f"{source}: expected a non-empty mapping of dotted config keys to "
                               f"distributions, got {data!r}")
    keys = valid_keys()
    space = {}
    for key, entry in data.items():
        _check_key(str(key), keys, source)
        space[str(key)] = parse_param(str(key), entry)
    grid = [k for k, spec in space.items() if spec.kind == "grid"]
    if grid and len(grid) != len(space):
        raise SearchSpaceError(f"{source}: grid entries {grid} cannot be mixed with sampled ones "
                               f"{[k for k in space if k not in grid]}: make every entry a grid, or none")
    return space


def grid_points(space: SearchSpace) -> int:
    """How many combinations a grid space has (0: the space is sampled, not a grid)."""
    if not space or any(spec.kind != "grid" for spec in space.values()):
        return 0
    return math.prod(len(spec.values) for spec in space.values())


def _check_key(key: str, keys: dict[str, Any], source: str) -> None:
    if key.startswith("sweep.") or key in SWEEP_OWNED:
        raise SearchSpaceError(f"{source}: {key!r} is set by the sweep itself and cannot be tuned; "
                               f"tunable keys are config keys except sweep.* and {list(SWEEP_OWNED)}")
    if key not in keys:
        close = sorted(k for k in keys if k.split(".")[-1] == key.split(".")[-1])
        hint = f"; did you mean {close}?" if close else "; `python jobs/train.py --help-config` lists them"
        raise SearchSpaceError(f"{source}: unknown config key {key!r} (search-space keys are the dotted "
                               f"keys of jobs/train.py){hint}")


def parse_param(key: str, entry: Any) -> ParamSpec:
    """One entry: ``{type: choice, values: [...]}`` or ``{type: uniform|loguniform|randint, low, high}``."""
    if not isinstance(entry, dict) or entry.get("type") not in KINDS:
        raise SearchSpaceError(f"search space {key}: expected a mapping with type one of {list(KINDS)}, "
                               f"got {entry!r}")
    kind = entry["type"]
    expected = {"type", "values"} if kind in LISTED else {"type", "low", "high"}
    if set(entry) != expected:
        raise SearchSpaceError(f"search space {key}: type {kind} takes exactly {sorted(expected)}, "
                               f"got {sorted(entry)}")
    if kind in LISTED:
        return _parse_choice(key, entry["values"], kind)
    return _parse_range(key, kind, entry["low"], entry["high"])


def _parse_choice(key: str, values: Any, kind: str = "choice") -> ParamSpec:
    ok = isinstance(values, list) and values and all(
        isinstance(v, (bool, int, float, str)) for v in values)
    if not ok or len(set(values)) != len(values):
        raise SearchSpaceError(f"search space {key}: {kind} values must be a non-empty list of distinct "
                               f"numbers, strings or booleans, got {values!r}")
    return ParamSpec(key, kind, values=tuple(values))


def _parse_range(key: str, kind: str, low: Any, high: Any) -> ParamSpec:
    number = int if kind == "randint" else float
    low, high = _number(key, "low", low, number), _number(key, "high", high, number)
    if not low < high:
        raise SearchSpaceError(f"search space {key}: {kind} needs low < high, got low={low!r}, high={high!r}")
    if kind == "loguniform" and low <= 0:
        raise SearchSpaceError(f"search space {key}: loguniform needs low > 0, got low={low!r}")
    return ParamSpec(key, kind, low=low, high=high)


def _number(key: str, name: str, value: Any, number: type) -> float | int:
    """``value`` as ``number``; YAML's '1e-4' (a string in YAML 1.1) is read as a float."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if number is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if number is float and isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value):
        return float(value)
    kind = "an integer (randint)" if number is int else "a finite number"
    raise SearchSpaceError(f"search space {key}: {name} must be {kind}, got {value!r}")


def check_against_config(space: SearchSpace, base: Config) -> None:
    """Build a Config from ``base`` at every bound of every distribution; the config's error explains."""
    data = to_dict(base)
    for spec in space.values():
        for label, value in spec.bounds():
            try:
                apply_params(data, {spec.key: value})
            except ConfigError as exc:
                raise SearchSpaceError(f"search space {spec.key}: {spec.kind} {label}={value!r} is rejected "
                                       f"by the config: {exc}") from exc


def apply_params(base: Config | dict, params: dict[str, Any]) -> Config:
    """A validated copy of ``base`` with each dotted key in ``params`` set."""
    data = to_dict(base) if isinstance(base, Config) else copy.deepcopy(base)
    for key, value in params.items():
        set_dotted(data, key, value)
    return from_dict(data)


def optuna_distributions(space: SearchSpace) -> dict[str, Any]:
    """The space as Optuna distributions (TPE samples these; randint is inclusive of high)."""
    import optuna.distributions as od

    out = {}
    for key, spec in space.items():
        if spec.kind in LISTED:
            out[key] = od.CategoricalDistribution(list(spec.values))
        elif spec.kind == "randint":
            out[key] = od.IntDistribution(int(spec.low), int(spec.high))
        else:
            out[key] = od.FloatDistribution(spec.low, spec.high, log=spec.kind == "loguniform")
    return out


def optuna_sampler(space: SearchSpace, seed: int):
    """TPE (seeded) for a sampled space; Optuna's GridSampler (seeded order) for a grid."""
    import optuna

    if grid_points(space):
        from puma.sweep.grid import AskTellGridSampler

        return AskTellGridSampler({k: list(s.values) for k, s in space.items()}, seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def space_to_dict(space: SearchSpace) -> dict:
    """The space in its YAML form (saved with the sweep)."""
    return {key: spec.to_dict() for key, spec in space.items()}
