"""The sweep's console: one progress display over its trials and a line per finished trial.

A Ray Tune callback (it runs on the sweep's driver). With it, Tune's own status tables stay off
(``verbose=0`` unless ``--verbose``) and the trials' own epoch lines and progress bars are not
shown (:func:`puma.console.show_remote`): several trials run at once, and the trial is the unit.
Tune pickles callbacks with the experiment and restores them on resume, so the display itself is
made in ``setup`` (each run) and never pickled; the trials already finished count from ``trials``.
"""

from __future__ import annotations

import math

from ray import tune

from puma import console

TAG = "[puma.sweep]"


class SweepProgress(tune.Callback):
    """Trials done out of ``sweep.num_samples``, the best objective so far, and how each trial ended."""

    def __init__(self, metric: str, mode: str, epochs: int) -> None:
        self.metric, self.mode, self.epochs = metric, mode, epochs
        self.best: float | None = None
        self.last: dict[str, dict] = {}  # trial id -> its last reported result
        self.bar: console.Progress | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "bar": None, "last": {}}

    def setup(self, stop=None, num_samples=None, total_num_samples=None, **info) -> None:
        """A fresh display for this run (a resumed sweep too)."""
        self.bar = console.progress("trials", total_num_samples or num_samples, "trials", tag=TAG)

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        """Remember the trial's latest result; track the best objective."""
        self.last[trial.trial_id] = result
        value = result.get(self.metric)
        if isinstance(value, (int, float)) and math.isfinite(value) and self._better(value):
            self.best = float(value)
        self._advance(trials)

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        """One line: the trial's objective, and whether ASHA stopped it early."""
        result = self.last.get(trial.trial_id, {})
        epoch, value = result.get("epoch"), result.get(self.metric)
        how = "completed" if epoch == self.epochs else f"stopped early by ASHA after epoch {epoch}"
        shown = f"{value:.4f}" if isinstance(value, (int, float)) else "-"
        console.say(f"trial {trial.trial_id} {how}: {self.metric}={shown}", tag=TAG)
        self._advance(trials, trial)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        """One line naming the trial's error file."""
        console.say(f"trial {trial.trial_id} failed; its error: {trial.path}/error.txt", tag=TAG)
        self._advance(trials, trial)

    def on_experiment_end(self, trials, **info) -> None:
        """The final line of the display."""
        if self.bar is not None:
            self._advance(trials)
            self.bar.close()

    def _advance(self, trials, ending=None) -> None:
        """Trials done: those Tune lists as finished (restored ones too), plus ``ending``."""
        if self.bar is None:
            return
        done = sum(t.status in ("TERMINATED", "ERROR") or t is ending for t in trials)
        self.bar.update(done - self.bar.done, note=self._note())

    def _better(self, value: float) -> bool:
        return self.best is None or (value > self.best if self.mode == "max" else value < self.best)

    def _note(self) -> str:
        return f"best {self.metric}={self.best:.4f}" if self.best is not None else ""


class TrialMetrics(tune.Callback):
    """Pushes the sweep's trials by state (started, finished, pruned by ASHA, failed) to the Pushgateway
    whenever one starts or ends (puma/job_metrics.py; metrics.pushgateway set)."""

    def __init__(self, cfg, sweep: str, epochs: int) -> None:
        self.cfg, self.sweep, self.epochs = cfg, sweep, epochs  # cfg: a MetricsConfig

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        self._push(trials)

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self._push(trials, trial, "TERMINATED")

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self._push(trials, trial, "ERROR")

    def on_experiment_end(self, trials, **info) -> None:
        self._push(trials)

    def _push(self, trials, ending=None, status: str = "") -> None:
        from puma.job_metrics import push_sweep

        push_sweep(self.cfg, self.sweep, trial_counts(trials, self.epochs, ending, status))


def trial_counts(trials, epochs: int, ending=None, status: str = "") -> dict[str, int]:
    """Trials started (not pending), finished (every epoch), pruned (stopped earlier) and failed;
    ``ending`` counts as ``status`` (Tune calls back before it sets the trial's status)."""
    counts = dict.fromkeys(("started", "finished", "pruned", "failed"), 0)
    for trial in trials:
        state = status if trial is ending else trial.status
        counts["started"] += state != "PENDING"
        if state == "ERROR":
            counts["failed"] += 1
        elif state == "TERMINATED":
            done = (trial.last_result or {}).get("epoch") == epochs
            counts["finished" if done else "pruned"] += 1
    return counts
