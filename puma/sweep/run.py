"""The sweep driver: plan (validate before Ray), then a new or restored Tuner, then the results.

Layout of a sweep directory ``<sweep.storage_path>/<sweep.name>`` (storage_path defaults to
``<train.storage_path>/sweeps``, so a cluster whose runs go to S3 keeps its sweeps there too)::

    sweep.yaml      the resolved config and search space it was started with (a resume must match)
    asha_rungs.json ASHA's rung records (Tune does not restore its scheduler; puma.sweep.asha does)
    tune/           Ray Tune's experiment (state, searcher, one folder per trial id)
    trials/<id>/    each trial's Ray Train run (checkpoints, best/, tensorboard)
    results/        trials.csv, trials.md, best_config.yaml, *.png, summary.json (puma.sweep.report)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import yaml

from puma import console, storage
from puma.cli import REPO_ROOT
from puma.config import Config, ConfigError, for_this_process, to_dict
from puma.sweep.space import (
    SearchSpace,
    check_against_config,
    grid_points,
    optuna_distributions,
    optuna_sampler,
    read_space,
    space_to_dict,
)
from puma.sweep.trial import run_trial, trial_config

DEFAULT_SPACE = REPO_ROOT / "tune" / "search_space.yaml"
TUNE_DIR = "tune"
PLAN_FILE = "sweep.yaml"
ASHA_FILE = "asha_rungs.json"
SNAPSHOT_PERIOD_S = "2"  # Tune snapshots experiment state (finished trials, searcher) every ~2 s, not >= 10 s


class SweepError(ConfigError):
    """A sweep cannot start or resume as asked; the message says why and what to do."""


@dataclass
class SweepPlan:
    """Everything a sweep needs, checked before Ray starts."""

    cfg: Config  # as given (relative paths kept): the best config is written from it
    resolved: Config  # absolute paths: what every trial starts from
    space: SearchSpace
    sweep_dir: str

    def record(self) -> dict:
        """What identifies this sweep (compared on resume)."""
        config = to_dict(self.resolved)
        config["sweep"].pop("resume")
        return {"config": config, "space": space_to_dict(self.space)}


def plan_sweep(cfg: Config) -> SweepPlan:
    """Read the space and validate it, the schedule and the metric against ``cfg``; no Ray here."""
    from puma.methods import check_config  # torch and every method: only once a sweep is planned

    resolved = for_this_process(cfg)
    check_config(resolved)
    space = read_space(resolved.sweep.space_file or str(DEFAULT_SPACE))
    check_against_config(space, resolved)
    points = grid_points(space)
    if points and resolved.sweep.num_samples != points:
        raise SweepError(f"sweep.num_samples={resolved.sweep.num_samples} must equal the grid's {points} "
                         "combinations (each is tried once)")
    _check_schedule(resolved)
    root = resolved.sweep.storage_path or storage.join(resolved.train.storage_path, "sweeps")
    sweep_dir = storage.join(root, resolved.sweep.name)
    trial_config(resolved, {}, sweep_dir, "check")  # the sweep's own trial keys must be valid too
    plan = SweepPlan(cfg, resolved, space, sweep_dir)
    if _experiment_exists(sweep_dir):
        _check_resumable(plan)
    return plan


def _check_schedule(cfg: Config) -> None:
    sweep = cfg.sweep
    if sweep.grace_period > cfg.train.epochs:
        raise SweepError(f"sweep.grace_period={sweep.grace_period} exceeds train.epochs={cfg.train.epochs}: "
                         "ASHA needs grace_period <= epochs")
    k = re.fullmatch(r".+/r@(\d+)", sweep.metric)
    if k and int(k.group(1)) not in cfg.eval.ks:
        raise SweepError(f"sweep.metric={sweep.metric!r} needs k={k.group(1)} in eval.ks={cfg.eval.ks}")


def run_sweep(plan: SweepPlan, callbacks: list | None = None):
    """Run (or resume) the sweep to the end and write its results; returns a SweepOutcome."""
    from puma.data.prepare import ensure_prepared
    from puma.sweep.placement import ReleaseStoppedTrainGroups
    from puma.sweep.progress import TAG, SweepProgress, TrialMetrics
    from puma.sweep.report import write_results

    storage.configure_once(plan.resolved.storage)
    ensure_prepared(plan.resolved)  # once, here: concurrent trials must not race to build the data
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", SNAPSHOT_PERIOD_S)
    console.show_remote(progress=False, tags=(TAG,))  # trials, not every trial's epochs
    if not console.is_verbose():  # Tune's new output prints its start banner even at verbose=0
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    sweep = plan.resolved.sweep
    progress = SweepProgress(sweep.metric, sweep.mode, plan.resolved.train.epochs)
    release = ReleaseStoppedTrainGroups.for_config(plan.resolved)
    pushed = [TrialMetrics(plan.resolved.metrics, sweep.name, plan.resolved.train.epochs)
              ] if plan.resolved.metrics.pushgateway else []
    grid = open_tuner(plan, [*(callbacks or []), progress, release, *pushed]).fit()
    return write_results(plan, grid)


def open_tuner(plan: SweepPlan, callbacks: list | None = None):
    """Restore the sweep's Tuner when its experiment exists (finished trials are kept), else a new one."""
    from ray import tune

    path, filesystem = _tune_location(plan.sweep_dir)
    trainable = _trainable(plan)
    if _experiment_exists(plan.sweep_dir):
        _check_resumable(plan)
        statuses = list(trial_statuses(plan.sweep_dir).values())
        done = statuses.count("TERMINATED")
        console.say(f"resuming {storage.redact(plan.sweep_dir)}: {done} finished trials kept, "
                    f"{len(statuses) - done} to resume", tag="[puma.sweep]")
        return tune.Tuner.restore(path, trainable=trainable, resume_unfinished=True, resume_errored=True,
                                  storage_filesystem=filesystem)
    record = yaml.safe_dump(plan.record(), sort_keys=False)
    storage.write_text(storage.join(plan.sweep_dir, PLAN_FILE), record)
    return tune.Tuner(trainable, tune_config=_tune_config(plan), run_config=_run_config(plan, callbacks))


def _experiment_exists(sweep_dir: str) -> bool:
    """Whether Tune saved a restorable experiment (its tuner.pkl and a state snapshot); no Ray needed."""
    from ray import tune

    path, filesystem = _tune_location(sweep_dir)
    if not tune.Tuner.can_restore(path, storage_filesystem=filesystem):
        return False  # killed before Tune saved anything: start afresh
    names = [uri.rsplit("/", 1)[-1] for uri in storage.list_files(storage.join(sweep_dir, TUNE_DIR),
                                                                 suffix=".json", recursive=False)]
    return any(name.startswith("experiment_state-") for name in names)


def _tune_location(sweep_dir: str):
    """(path, filesystem) of the Tune experiment, for Tune's storage_path / restore arguments."""
    return storage.ray_storage(storage.join(sweep_dir, TUNE_DIR))


def _trainable(plan: SweepPlan):
    """The trial function with the base config bound and a small CPU share (workers bring their own)."""
    from ray import tune

    bound = tune.with_parameters(run_trial, base=to_dict(plan.resolved), sweep_dir=plan.sweep_dir)
    return tune.with_resources(bound, {"cpu": plan.resolved.sweep.cpus_per_trial})


def _tune_config(plan: SweepPlan):
    """Optuna TPE (seeded) proposes, ASHA stops weak trials at epoch rungs."""
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    from puma.sweep.asha import ResumableASHA

    sweep = plan.resolved.sweep
    if not console.is_verbose():
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # not "A new study created in memory ..."
    searcher = OptunaSearch(space=optuna_distributions(plan.space), metric=sweep.metric, mode=sweep.mode,
                            sampler=optuna_sampler(plan.space, sweep.seed))
    scheduler = ResumableASHA(storage.join(plan.sweep_dir, ASHA_FILE), time_attr="epoch", metric=sweep.metric,
                              mode=sweep.mode, max_t=plan.resolved.train.epochs,
                              grace_period=sweep.grace_period, reduction_factor=sweep.reduction_factor,
                              stop_last_trials=False)  # the last epoch ends the trial itself (placement.py)
    return tune.TuneConfig(search_alg=searcher, scheduler=scheduler, num_samples=sweep.num_samples,
                           max_concurrent_trials=sweep.max_concurrent_trials,
                           trial_dirname_creator=trial_dirname)


def trial_dirname(trial) -> str:
    """A trial's folder under tune/ is its id (the same id names its Ray Train run)."""
    return trial.trial_id


def _run_config(plan: SweepPlan, callbacks: list | None):
    from ray import tune

    path, filesystem = _tune_location(plan.sweep_dir)
    parent, name = os.path.split(path.rstrip("/"))
    return tune.RunConfig(name=name, storage_path=parent, storage_filesystem=filesystem,
                          failure_config=tune.FailureConfig(max_failures=0), callbacks=callbacks,
                          verbose=1 if console.is_verbose() else 0)  # our display: puma.sweep.progress


def _check_resumable(plan: SweepPlan) -> None:
    """A resume must use the config and space the sweep started with, and sweep.resume must allow it."""
    if not plan.resolved.sweep.resume:
        raise SweepError(f"sweep {storage.redact(plan.sweep_dir)} exists and sweep.resume=false; "
                         "choose another sweep.name or drop sweep.resume=false to resume it")
    uri = storage.join(plan.sweep_dir, PLAN_FILE)
    if not storage.exists(uri):
        return
    started = yaml.safe_load(storage.read_text(uri))
    defaults = {"config": to_dict(Config())}  # a key added to the code since keeps its default: no change
    changed = _diff(started, plan.record(), defaults=defaults)
    if changed:
        raise SweepError(f"sweep {storage.redact(plan.sweep_dir)} was started with other settings; changed: "
                         f"{changed[:10]}. Re-run with the same config, space and overrides, or choose "
                         "another sweep.name")


def _diff(old: dict, new: dict, prefix: str = "", defaults: dict | None = None) -> list[str]:
    """Dotted keys whose values differ between two nested dicts; a key only ``new`` has is no change
    when its value is the one in ``defaults`` (a config field added since the sweep started)."""
    out, defaults = [], defaults or {}
    for key in sorted(set(old) | set(new)):
        a, b, name = old.get(key), new.get(key), f"{prefix}{key}"
        default = defaults.get(key) if isinstance(defaults, dict) else None
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{name}.", default if isinstance(default, dict) else None)
        elif key not in old and key in defaults and b == default:
            continue
        elif a != b:
            out.append(f"{name}: {a!r} -> {b!r}")
    return out


def trial_statuses(sweep_dir: str) -> dict[str, str]:
    """Trial id -> Tune status (PENDING, RUNNING, TERMINATED, ERROR) as last saved; {} before any save."""
    from ray import tune

    if not _experiment_exists(sweep_dir):
        return {}
    path, filesystem = _tune_location(sweep_dir)
    try:
        analysis = tune.ExperimentAnalysis(path, storage_filesystem=filesystem)
    except ValueError:  # a snapshot being copied in by a running sweep (not atomic): read again later
        return {}
    return {trial.trial_id: trial.status for trial in analysis.trials}
