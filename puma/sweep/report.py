"""Sweep results: a table of every trial (CSV + markdown), the best config as YAML, Optuna plots.

Definitions (per trial, read from Tune's per-epoch results):

- ``objective``: the last reported value of ``sweep.metric`` on the validation classes; this is
  the value Optuna's TPE was told when the trial ended (ASHA-stopped trials included).
- ``status``: ``completed`` (ran train.epochs), ``stopped early`` (ASHA stopped it at a rung),
  ``error`` (the trial raised; see Tune's error file in its folder).
- the best trial: the best finite objective under ``sweep.mode`` (Tune's ``scope='last'``).

The plots come from an Optuna study rebuilt from these rows (optimisation history; parameter
importance by fANOVA, which needs at least two trials with an objective).
"""

from __future__ import annotations

import csv
import io
import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from puma import storage
from puma.config import dump_yaml, load_config, to_dict
from puma.sweep.space import apply_params, optuna_distributions
from puma.sweep.trial import TRIALS_DIR, format_params

RESULTS_DIR = "results"


@dataclass
class TrialRow:
    """One trial of the table."""

    trial_id: str
    status: str
    epochs: int
    objective: float
    params: dict[str, Any]
    history: dict[int, float] = field(default_factory=dict)  # epoch -> objective
    started: float = math.inf  # time of the trial's first report (orders the trials)
    train_loss: float = math.nan
    time_s: float = math.nan
    run_uri: str = ""


@dataclass
class SweepOutcome:
    """What a finished sweep left behind."""

    sweep_dir: str
    rows: list[TrialRow]
    best: TrialRow | None
    files: dict[str, str]  # name -> URI of each results file
    notes: list[str] = field(default_factory=list)  # why a file was not written


def collect_rows(plan, grid) -> list[TrialRow]:
    """One row per trial of a Tune ResultGrid, in the order the trials first reported."""
    metric, epochs = plan.resolved.sweep.metric, plan.resolved.train.epochs
    rows = [_row(result, metric, epochs, plan.sweep_dir) for result in grid]
    return sorted(rows, key=lambda r: (r.started, r.trial_id))


def _row(result, metric: str, max_epochs: int, sweep_dir: str) -> TrialRow:
    metrics = result.metrics or {}
    trial_id = str(metrics.get("trial_id") or str(result.path).rstrip("/").split("/")[-1])
    frame = result.metrics_dataframe
    history, started = {}, math.inf
    if frame is not None and metric in frame and "epoch" in frame:
        history = {int(e): float(v) for e, v in zip(frame["epoch"], frame[metric], strict=True)
                   if not math.isnan(float(v))}
    if frame is not None and "timestamp" in frame and len(frame):
        started = float(frame["timestamp"].min())
    epochs = int(metrics.get("epoch", 0))
    status = "completed" if epochs >= max_epochs else "stopped early"
    if result.error is not None:
        status = "error"
    return TrialRow(trial_id=trial_id, status=status, epochs=epochs,
                    objective=float(metrics.get(metric, math.nan)), params=dict(result.config or {}),
                    history=history, started=started, train_loss=float(metrics.get("train/loss", math.nan)),
                    time_s=float(metrics.get("time_total_s", math.nan)),
                    run_uri=storage.join(sweep_dir, TRIALS_DIR, trial_id))


def best_row(rows: list[TrialRow], mode: str) -> TrialRow | None:
    """The trial with the best finite objective (None when no trial reported one)."""
    scored = [r for r in rows if math.isfinite(r.objective)]
    if not scored:
        return None
    pick = max if mode == "max" else min
    return pick(scored, key=lambda r: r.objective)


def write_results(plan, grid) -> SweepOutcome:
    """Write every results file under <sweep dir>/results and return what was written."""
    rows = collect_rows(plan, grid)
    best = best_row(rows, plan.resolved.sweep.mode)
    out = storage.join(plan.sweep_dir, RESULTS_DIR)
    outcome = SweepOutcome(sweep_dir=plan.sweep_dir, rows=rows, best=best, files={})
    keys = list(plan.space)
    _write(outcome, out, "trials.csv", trials_csv(rows, keys, plan.resolved.sweep.metric))
    _write(outcome, out, "trials.md", trials_markdown(rows, keys, plan.resolved.sweep.metric,
                                                      plan.resolved.sweep.mode))
    if best is not None:
        _write(outcome, out, "best_config.yaml", best_config_yaml(plan, best))
        check_best_config(outcome.files["best_config.yaml"], plan, best)
    else:
        outcome.notes.append("no trial reported the objective: no best_config.yaml")
    write_plots(plan, rows, out, outcome)
    _write(outcome, out, "summary.json", json.dumps(summary(plan, outcome), indent=2) + "\n")
    return outcome


def _write(outcome: SweepOutcome, folder: str, name: str, data: str | bytes) -> None:
    uri = storage.join(folder, name)
    if isinstance(data, str):
        storage.write_text(uri, data)
    else:
        storage.write_bytes(uri, data)
    outcome.files[name] = uri


def _cells(row: TrialRow, keys: list[str]) -> list[Any]:
    return [row.trial_id, row.status, row.epochs, row.objective, *[row.params.get(k) for k in keys],
            row.train_loss, row.time_s, row.run_uri]


def _header(keys: list[str], metric: str) -> list[str]:
    return ["trial_id", "status", "epochs", metric, *keys, "train/loss", "time_s", "run"]


def trials_csv(rows: list[TrialRow], keys: list[str], metric: str) -> str:
    """Every trial as CSV: id, status, epochs, objective, each tuned key, loss, time, run folder."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(_header(keys, metric))
    writer.writerows(_cells(r, keys) for r in rows)
    return buf.getvalue()


def trials_markdown(rows: list[TrialRow], keys: list[str], metric: str, mode: str = "max") -> str:
    """Every trial as a markdown table, best objective first."""
    header = _header(keys, metric)[:-1]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    sign = -1.0 if mode == "max" else 1.0
    ordered = sorted(rows, key=lambda r: (not math.isfinite(r.objective),
                                          sign * r.objective if math.isfinite(r.objective) else 0.0))
    for row in ordered:
        lines.append("| " + " | ".join(_fmt(v) for v in _cells(row, keys)[:-1]) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def best_config_yaml(plan, best: TrialRow) -> str:
    """A complete config for jobs/train.py: the sweep's base config plus the best trial's values.

    The validation carve-out and per-trial run folders are not carried over: the final training
    uses all training classes and evaluates the split the base config names.
    """
    cfg = apply_params(plan.cfg, {**best.params, "train.run_name": f"{plan.cfg.sweep.name}-best"})
    sweep = plan.cfg.sweep
    header = [f"# Best trial {best.trial_id} of sweep {sweep.name}: {sweep.metric}={best.objective:.4f} "
              f"on validation classes ({best.epochs} epochs, {best.status}).",
              f"# Tuned values: {format_params(best.params)}",
              "# Train with: python jobs/train.py --config <this file>"]
    return "\n".join(header) + "\n" + dump_yaml(cfg)


def check_best_config(uri: str, plan, best: TrialRow) -> None:
    """Load the written best config the way jobs/train.py does; it must hold the best values."""
    loaded = load_config(uri)
    expected = apply_params(plan.cfg, {**best.params, "train.run_name": f"{plan.cfg.sweep.name}-best"})
    if to_dict(loaded) != to_dict(expected):
        raise RuntimeError(f"{uri} does not load back to the best trial's config")


def optuna_study(plan, rows: list[TrialRow]):
    """An Optuna study holding every trial that reported the objective (for plots and importance)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    direction = "maximize" if plan.resolved.sweep.mode == "max" else "minimize"
    study = optuna.create_study(direction=direction, study_name=plan.resolved.sweep.name)
    dists = optuna_distributions(plan.space)
    trials = [optuna.trial.create_trial(params={k: r.params[k] for k in dists}, distributions=dists,
                                        value=r.objective, intermediate_values=r.history,
                                        user_attrs={"trial_id": r.trial_id, "status": r.status})
              for r in rows if math.isfinite(r.objective) and all(k in r.params for k in dists)]
    study.add_trials(trials)
    return study


def write_plots(plan, rows: list[TrialRow], folder: str, outcome: SweepOutcome) -> None:
    """optimization_history.png and param_importances.png (fANOVA), from the rebuilt study."""
    import matplotlib

    matplotlib.use("Agg")
    from optuna.importance import FanovaImportanceEvaluator
    from optuna.visualization import matplotlib as vis

    study = optuna_study(plan, rows)
    if not study.trials:
        outcome.notes.append("no trial reported the objective: no plots")
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optuna's matplotlib plots are marked experimental
        _write(outcome, folder, "optimization_history.png", _png(vis.plot_optimization_history(study)))
        if len(study.trials) < 2:
            outcome.notes.append("parameter importance needs at least two trials with an objective")
            return
        evaluator = FanovaImportanceEvaluator(seed=plan.resolved.sweep.seed)
        try:
            ax = vis.plot_param_importances(study, evaluator=evaluator)
        except (RuntimeError, ValueError) as exc:  # e.g. every trial scored the same: zero variance
            outcome.notes.append(f"no parameter importance: {exc}")
            return
        _write(outcome, folder, "param_importances.png", _png(ax))


def _png(ax) -> bytes:
    import matplotlib.pyplot as plt

    figure = ax.figure
    figure.tight_layout()
    buf = io.BytesIO()
    figure.savefig(buf, format="png", dpi=100)
    plt.close(figure)
    return buf.getvalue()


def summary(plan, outcome: SweepOutcome) -> dict:
    """The sweep in one JSON object: objective, best trial, counts, files."""
    counts: dict[str, int] = {}
    for row in outcome.rows:
        counts[row.status] = counts.get(row.status, 0) + 1
    best = outcome.best
    return {"metric": plan.resolved.sweep.metric, "mode": plan.resolved.sweep.mode,
            "split": "val", "val_fraction": plan.resolved.sweep.val_fraction,
            "trials": len(outcome.rows), "status_counts": counts,
            "best": None if best is None else {"trial_id": best.trial_id, "objective": best.objective,
                                               "params": best.params, "epochs": best.epochs},
            "files": dict(outcome.files), "notes": list(outcome.notes)}
