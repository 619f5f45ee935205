"""``sweep``: the Ray Tune sweep (puma/sweep, tune/sweep.py)."""

from __future__ import annotations

from dataclasses import dataclass

from puma.config.checks import _check, _check_choice


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
