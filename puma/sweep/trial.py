"""One sweep trial: the training code path of jobs/train.py, run inside a Ray Tune function.

Ray 2.60 (Train V2) cannot tune a TorchTrainer directly; the Tune function builds the trial's
config, calls ``run_training`` and passes Tune's ``TuneReportCallback`` as a Ray Train callback,
so every epoch's report (``epoch``, ``harmonic/r@1``, ...) reaches Tune, Optuna and ASHA.
"""

from __future__ import annotations

from typing import Any

from puma import console, storage
from puma.config import Config, from_dict
from puma.sweep.space import apply_params

TRIALS_DIR = "trials"  # <sweep dir>/trials/<trial id>: each trial's Ray Train run (checkpoints, best/)


def trial_overrides(cfg: Config, sweep_dir: str, trial_id: str) -> dict[str, Any]:
    """What the sweep sets in every trial: its own run under the sweep, scored on validation classes."""
    return {"train.run_name": trial_id, "train.storage_path": storage.join(sweep_dir, TRIALS_DIR),
            "data.val_fraction": cfg.sweep.val_fraction, "train.eval_split": "val",
            "train.eval_every": 1,  # ASHA compares trials at every epoch
            "train.best_metric": cfg.sweep.metric}


def trial_config(base: Config, params: dict[str, Any], sweep_dir: str, trial_id: str) -> Config:
    """The trial's config: base, then the sampled ``params`` (dotted keys), then the sweep's own keys."""
    return apply_params(base, {**params, **trial_overrides(base, sweep_dir, trial_id)})


def format_params(params: dict[str, Any]) -> str:
    """``key=value`` pairs, floats to 4 significant digits."""
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(params.items()))


def run_trial(params: dict[str, Any], base: dict, sweep_dir: str) -> None:
    """Ray Tune function: train with Ray Train; each epoch's metrics are reported to Tune."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from puma.train.driver import run_training

    trial_id = tune.get_context().get_trial_id()
    cfg = trial_config(from_dict(base), params, sweep_dir, trial_id)
    console.say(f"trial {trial_id} starts: {format_params(params)}", tag="[puma.sweep]")
    run_training(cfg, callbacks=[TuneReportCallback()])
