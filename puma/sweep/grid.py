"""Optuna's GridSampler for Ray Tune's ask/tell OptunaSearch (a module of its own: Tune pickles it)."""

from __future__ import annotations

import optuna


class AskTellGridSampler(optuna.samplers.GridSampler):
    """Every grid point once, in a seeded order, without ``study.stop()`` after the last point.

    GridSampler stops the study from ``after_trial`` once every point was visited; that only works
    inside ``study.optimize`` (under ask/tell, as Ray's OptunaSearch drives it, it raises and the last
    trial would fail). The sweep's ``num_samples`` equals the number of points, so nothing more is asked.
    """

    def after_trial(self, study, trial, state, values) -> None:
        return None
