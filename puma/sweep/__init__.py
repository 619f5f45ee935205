"""Hyperparameter sweeps with Ray Tune: Optuna TPE search, ASHA early stopping, results and plots.

- ``space``: the search-space YAML (dotted config keys) and its validation against ``Config``.
- ``trial``: the Ray Tune function that runs the jobs/train.py training path for one trial.
- ``run``: plan (all checks before Ray), new or restored ``Tuner``, run to the end.
- ``report``: trials table (CSV, markdown), best config YAML, optimisation plots.
"""

from puma.sweep.run import SweepError, SweepPlan, plan_sweep, run_sweep
from puma.sweep.space import SearchSpaceError, parse_space, read_space

__all__ = ["SearchSpaceError", "SweepError", "SweepPlan", "parse_space", "plan_sweep", "read_space",
           "run_sweep"]
