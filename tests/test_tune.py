"""Sweeps (tune/sweep.py, puma.sweep) on real images with a tiny model.

Fast tests (no Ray): the search space is keyed by config keys and every bound is built into a real
Config, so unknown keys and bad ranges fail before any trial. One real sweep (Optuna TPE + ASHA,
2 trials, 2 epochs each) is killed after its first trial finishes and re-run with the same
command: finished trials are not re-run, ASHA stops a trial early, the results are written and
the best config is the base with the best values and passes jobs/train.py's driver checks.
"""

from __future__ import annotations

import copy
import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from kill_harness import attempt_records, complete_checkpoints
from pushgateway import Pushgateway, used_by_monitoring
from tiny import TINY_BACKBONE

from puma.config import load_config, to_dict
from puma.data.prepare import prepare
from puma.data.sources import SourceSpec
from puma.sweep import SearchSpaceError, SweepError, parse_space, plan_sweep
from puma.sweep.report import SweepOutcome, TrialRow, best_row, trials_markdown, write_plots
from puma.sweep.run import trial_statuses
from puma.sweep.space import grid_points, optuna_distributions, optuna_sampler
from puma.sweep.trial import trial_config
from tune import sweep as sweep_job

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "data"
PYTHON = sys.executable
NUM_SAMPLES, EPOCHS = 2, 2  # a good and a bad learning rate: each trial is a Ray Train run (30-60 s)
GOOD_LR, BAD_LR = 3.0e-4, 1.0
# A learning rate far too large is a reliably bad region (harmonic R@1 ~0.05 after one epoch against
# ~0.11), so ASHA's decision does not hinge on training noise; Optuna's TPE is seeded and its first
# draws are random start-up samples, so sweep.seed=1 proposes a good, then a bad learning rate.
TEST_SPACE = {
    "model.adapter.rank": {"type": "choice", "values": [4, 8]},
    "model.adapter.keep_prob": {"type": "uniform", "low": 0.5, "high": 1.0},
    "optim.lr": {"type": "choice", "values": [GOOD_LR, BAD_LR]},
}





def tiny_config(path: Path, data_uri: str, sweeps: str, runs: str) -> Path:
    """A complete YAML config for a tiny sweep: 2 trials, 2 epochs, ASHA rung at epoch 1."""
    cfg = {
        "model": {"backbone": dict(TINY_BACKBONE), "adapter": {"rank": 8},
                  "prompt_pool": {"pool_size": 4, "length": 2}, "head": {"embed_dim": 16}},
        "data": {"uri": data_uri, "preset": "", "decode_batch_size": 16},
        "train": {"epochs": EPOCHS, "batch_size": 16, "max_steps_per_epoch": 2, "cpus_per_worker": 0.5,
                  "storage_path": runs, "run_name": "base", "max_failures": 0},
        "eval": {"batch_size": 64},
        "sweep": {"storage_path": sweeps, "name": "tiny", "num_samples": NUM_SAMPLES, "seed": 1,
                  "max_concurrent_trials": 1, "grace_period": 1, "reduction_factor": 3,
                  "val_fraction": 0.34},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Real photos and drawings prepared to Parquet: flowers 12 species x 10, omniglot 242 x 4."""
    root = tmp_path_factory.mktemp("sweep")
    data = str(root / "data")
    specs = [SourceSpec("folder", "flowers", str(SHARED / "flowers12-subset"), 1, 10),
             SourceSpec("folder", "omniglot", str(SHARED / "omniglot-subset"), 2, 4)]
    prepare(specs, data, log=lambda _: None)
    config = tiny_config(root / "tiny.yaml", data, str(root / "sweeps"), str(root / "runs"))
    gateway = Pushgateway(root / "pushgateway")  # the sweep pushes its trials by state there
    config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()),
                                      "metrics": {"pushgateway": gateway.url}}))
    space = root / "space.yaml"
    space.write_text(yaml.safe_dump(TEST_SPACE))
    yield {"root": root, "config": config, "space": space, "sweep_dir": root / "sweeps" / "tiny",
           "gateway": gateway}
    gateway.stop()


# ----------------------------------------------------------------------------- before any trial


def test_default_space_covers_the_paper_knobs_and_fits_the_demo_config(tmp_path):
    plan = plan_sweep(load_config(REPO / "configs" / "demo.yaml", [f"sweep.storage_path={tmp_path}"]))
    assert set(plan.space) == {"model.adapter.rank", "model.adapter.keep_prob", "model.prompt_pool.pool_size",
                               "model.prompt_pool.length", "optim.lr"}
    assert {s.kind for s in plan.space.values()} == {"choice", "uniform", "randint", "loguniform"}
    dists = optuna_distributions(plan.space)
    assert dists["optim.lr"].log and dists["model.prompt_pool.length"].high == 16  # randint: inclusive


BAD_SPACES = [
    ({"model.adapter.rnak": {"type": "choice", "values": [4]}}, r"unknown config key 'model.adapter.rnak'"),
    ({"adapter.rank": {"type": "choice", "values": [4]}}, r"did you mean \['model.adapter.rank'"),
    ({"data.val_fraction": {"type": "uniform", "low": 0.1, "high": 0.3}}, r"set by the sweep itself"),
    ({"sweep.seed": {"type": "randint", "low": 0, "high": 3}}, r"set by the sweep itself"),
    ({"model.adapter.keep_prob": {"type": "uniform", "low": 0.5, "high": 1.5}},
     r"keep_prob: uniform high=1.5 is rejected by the config: .*valid: 0 < p <= 1"),
    ({"optim.lr": {"type": "uniform", "low": 1e-3, "high": 1e-3}}, r"needs low < high"),
    ({"optim.lr": {"type": "loguniform", "low": 0.0, "high": 1e-3}}, r"loguniform needs low > 0"),
    ({"loss.name": {"type": "choice", "values": ["arcface", "nope"]}},
     r"values\[1\]='nope' is rejected by the config: loss.name='nope' is not valid"),
    ({"model.adapter.rank": {"type": "uniform", "low": 4, "high": 64}}, r"expected int, got 4.0"),
    ({"model.adapter.rank": {"type": "randint", "low": 4.5, "high": 64}}, r"low must be an integer"),
    ({"optim.lr": {"type": "normal", "low": 0.1, "high": 1}}, r"type one of \['choice'"),
    ({"optim.lr": {"type": "uniform", "low": 0.1}}, r"takes exactly \['high', 'low', 'type'\]"),
    ({"optim.lr": {"type": "grid", "values": [1e-4, 1e-4]}}, r"grid values must be a non-empty list"),
    ({"optim.lr": {"type": "grid", "values": [1e-4]},
      "model.adapter.rank": {"type": "choice", "values": [4]}},
     r"grid entries \['optim.lr'\] cannot be mixed with sampled ones \['model.adapter.rank'\]"),
]


@pytest.mark.parametrize(("space", "message"), BAD_SPACES, ids=[m[:28] for _, m in BAD_SPACES])
def test_bad_search_space_is_rejected_before_ray(tmp_path, space, message):
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    cfg = load_config(None, [f"sweep.space_file={path}", f"sweep.storage_path={tmp_path / 'sweeps'}"])
    with pytest.raises(SearchSpaceError, match=message):
        plan_sweep(cfg)


def test_cli_stops_on_a_bad_space_before_any_trial(tmp_path, capsys):
    space = tmp_path / "space.yaml"
    space.write_text("model.adapter.keep_prob: {type: uniform, low: 0.5, high: 1.5}\n")
    rc = sweep_job.main(["--space", str(space), f"sweep.storage_path={tmp_path / 'sweeps'}"])
    assert rc == 2
    assert "model.adapter.keep_prob: uniform high=1.5 is rejected" in capsys.readouterr().err
    assert not (tmp_path / "sweeps").exists(), "nothing may be written before the space is valid"
    with pytest.raises(SearchSpaceError, match="search-space file .* not found"):
        plan_sweep(load_config(None, [f"sweep.space_file={tmp_path / 'missing.yaml'}",
                                      f"sweep.storage_path={tmp_path / 'sweeps'}"]))


def test_a_grid_space_tries_every_combination_once_in_place_of_tpe(tmp_path):
    import optuna

    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({"optim.lr": {"type": "grid", "values": [3e-5, 1e-4, 3e-4]},
                                    "model.adapter.rank": {"type": "grid", "values": [4, 8]}}))
    base = [f"sweep.space_file={path}", f"sweep.storage_path={tmp_path / 'sweeps'}"]
    with pytest.raises(SweepError, match="sweep.num_samples=8 must equal the grid's 6 combinations"):
        plan_sweep(load_config(None, base))
    plan = plan_sweep(load_config(None, [*base, "sweep.num_samples=6"]))
    assert grid_points(plan.space) == 6 and grid_points(parse_space(TEST_SPACE)) == 0
    sampler = optuna_sampler(plan.space, seed=0)
    assert isinstance(sampler, optuna.samplers.GridSampler)
    assert isinstance(optuna_sampler(parse_space(TEST_SPACE), seed=0), optuna.samplers.TPESampler)
    study = optuna.create_study(sampler=sampler, direction="maximize")
    dists = optuna_distributions(plan.space)
    seen = []
    for _ in range(6):
        trial = study.ask(dists)
        seen.append((trial.params["optim.lr"], trial.params["model.adapter.rank"]))
        study.tell(trial, 0.0)
    assert sorted(seen) == sorted((lr, r) for lr in (3e-5, 1e-4, 3e-4) for r in (4, 8))


def test_sweep_options_are_checked_before_ray(tmp_path):
    where = f"sweep.storage_path={tmp_path}"
    with pytest.raises(SweepError, match="grace_period=5 exceeds train.epochs=3"):
        plan_sweep(load_config(None, ["train.epochs=3", "sweep.grace_period=5", where]))
    with pytest.raises(SweepError, match=r"needs k=16 in eval.ks=\[1, 2, 4, 8\]"):
        plan_sweep(load_config(None, ["sweep.metric=harmonic/r@16", where]))


def test_trials_score_validation_classes_in_their_own_run(tmp_path):
    base = load_config(None, ["sweep.val_fraction=0.25", "data.val_fraction=0.0", "train.eval_split=test"])
    space = parse_space(TEST_SPACE)
    assert set(space) == set(TEST_SPACE)
    cfg = trial_config(base, {"model.adapter.rank": 4, "optim.lr": 0.01}, str(tmp_path / "s"), "abc123")
    assert (cfg.train.eval_split, cfg.data.val_fraction, cfg.train.eval_every) == ("val", 0.25, 1)
    assert (cfg.train.run_name, cfg.train.storage_path) == ("abc123", str(tmp_path / "s" / "trials"))
    assert (cfg.model.adapter.rank, cfg.optim.lr, cfg.train.best_metric) == (4, 0.01, "harmonic/r@1")


def test_report_picks_the_best_by_mode_and_explains_a_missing_importance_plot(tmp_path):
    plan = plan_sweep(load_config(None, [f"sweep.storage_path={tmp_path}", "sweep.mode=min"]))
    params = [{"model.adapter.rank": 16, "model.adapter.keep_prob": 0.5, "model.prompt_pool.pool_size": 5,
               "model.prompt_pool.length": 2, "optim.lr": lr} for lr in (1e-4, 1e-3)]
    rows = [TrialRow("a", "completed", 3, 0.5, params[0], {1: 0.6, 3: 0.5}),
            TrialRow("b", "stopped early", 1, 0.5, params[1], {1: 0.5}),
            TrialRow("c", "error", 0, math.nan, {})]
    assert best_row(rows, "min").trial_id == "a" and best_row(rows[2:], "max") is None
    outcome = SweepOutcome(plan.sweep_dir, rows, None, {})
    write_plots(plan, rows, str(tmp_path / "out"), outcome)  # equal objectives: no importance to show
    assert list(outcome.files) == ["optimization_history.png"]
    assert outcome.notes and "no parameter importance" in outcome.notes[0]
    table = trials_markdown(rows, list(plan.space), "harmonic/r@1", "min")
    assert table.splitlines()[-1].startswith("| c | error | 0 |  |")  # no objective: last, empty cell


# ----------------------------------------------------------------------------- a real sweep


def _command(setup: dict) -> list[str]:
    return [PYTHON, "tune/sweep.py", "--config", str(setup["config"]), "--space", str(setup["space"])]


def _files(folder: Path, content: bool = False) -> dict[str, object]:
    """path -> mtime_ns of each file under ``folder``, or its bytes (for files Tune re-copies unchanged)."""
    return {str(p.relative_to(folder)): p.read_bytes() if content else p.stat().st_mtime_ns
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _trial_files(sweep_dir: Path, trial_id: str) -> tuple[dict, dict]:
    """Tune's files of a trial (results, params: compared by content) and its Ray Train run (by mtime)."""
    return _files(sweep_dir / "tune" / trial_id, content=True), _files(sweep_dir / "trials" / trial_id)


def _wait_for_finished_trial(process: subprocess.Popen, sweep_dir: Path, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        statuses = trial_statuses(str(sweep_dir))
        if "TERMINATED" in statuses.values():
            return statuses
        time.sleep(1.0)
    raise AssertionError(f"no trial was recorded as finished within {timeout}s (driver rc {process.poll()})")


# the budget of every test that needs the killed-and-resumed sweep: whichever runs first pays for it
# (94 s alone, 154 s beside another module; the best config's training adds 22-34 s)
SWEEP_BUDGET = pytest.mark.budget(310)


@pytest.fixture(scope="module")
def resumed_sweep(ray_cluster, setup) -> dict:
    """Run the sweep, SIGKILL its driver once a trial is recorded finished, re-run the same command."""
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address, PYTHONUNBUFFERED="1")
    log1 = setup["root"] / "first.log"
    with open(log1, "w") as out:
        first = subprocess.Popen(_command(setup), cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            at_kill = _wait_for_finished_trial(first, setup["sweep_dir"], timeout=600)
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
    finished = sorted(t for t, s in at_kill.items() if s == "TERMINATED")
    before = {t: _trial_files(setup["sweep_dir"], t) for t in finished}
    second = subprocess.run(_command(setup), cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    output = second.stdout + second.stderr
    assert second.returncode == 0, output[-4000:] + "\n--- first run:\n" + log1.read_text()[-3000:]
    after = {t: _trial_files(setup["sweep_dir"], t) for t in finished}
    results = setup["sweep_dir"] / "results"
    with open(results / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    return {"at_kill": at_kill, "finished": finished, "before": before, "after": after, "output": output,
            "rows": rows, "results": results, "summary": json.loads((results / "summary.json").read_text())}


@SWEEP_BUDGET
def test_killed_sweep_resumes_without_rerunning_finished_trials(resumed_sweep, setup):
    finished, output = resumed_sweep["finished"], resumed_sweep["output"]
    assert finished and len(resumed_sweep["at_kill"]) < NUM_SAMPLES + 1
    assert f"resuming {setup['sweep_dir']}: {len(finished)} finished trials kept" in output
    started_here = set(re.findall(r"\[puma\.sweep\] trial (\w+) starts", output))
    for trial_id in finished:
        assert trial_id not in started_here, f"finished trial {trial_id} was run again"
        assert resumed_sweep["after"][trial_id] == resumed_sweep["before"][trial_id], \
            f"files of finished trial {trial_id} changed on resume"
    rows = resumed_sweep["rows"]
    ids = {r["trial_id"] for r in rows}
    assert len(rows) == NUM_SAMPLES and len(ids) == NUM_SAMPLES
    assert set(finished) <= ids and started_here == ids - set(finished)  # the others all ran here
    assert all(r["status"] in ("completed", "stopped early") for r in rows), rows


@SWEEP_BUDGET
def test_restored_trials_continue_from_their_newest_complete_checkpoint(resumed_sweep, setup):
    """Tuner.restore re-runs an unfinished trial's training with its run name: the same rule as a
    re-run driver. No trial writes an epoch twice; each later attempt continues after the newest
    epoch complete before it (every folder is kept: checkpoints_to_keep 2 >= 2 epochs)."""
    runs = sorted(p for p in (setup["sweep_dir"] / "trials").iterdir() if p.is_dir())
    assert len(runs) == NUM_SAMPLES
    for run in runs:
        written = complete_checkpoints(run)
        epochs = sorted(f["epoch"] for f in written)
        assert epochs == list(range(1, len(epochs) + 1)), f"trial {run.name} wrote epochs {epochs}"
        for record in attempt_records(run)[1:]:
            before = [f["epoch"] for f in written if f["attempt"] < record["attempt"]]
            assert record["after_epoch"] == max(before, default=0), (run.name, record)


@SWEEP_BUDGET
def test_asha_stops_the_bad_trial_early_and_decides_every_trial_by_its_rule(resumed_sweep, setup):
    """The bad lr is stopped at the first rung; every other decision is ASHA's rule applied to the rung
    records in run order (stopped iff below the (1 - 1/rf) percentile of the earlier records), so a
    good trial that happens to land below that cutoff (the tiny model is noisy) is stopped correctly."""
    import numpy as np

    rows = resumed_sweep["rows"]  # in the order the trials ran
    assert [float(r["optim.lr"]) for r in rows] == [GOOD_LR, BAD_LR], "seeded TPE proposals changed"
    bad = next(r for r in rows if float(r["optim.lr"]) == BAD_LR)
    assert (bad["status"], int(bad["epochs"])) == ("stopped early", 1), rows
    rung = json.loads((setup["sweep_dir"] / "asha_rungs.json").read_text())["brackets"][0][0]
    assert rung["milestone"] == 1.0 and list(rung["recorded"]) == [r["trial_id"] for r in rows], rung
    values = list(rung["recorded"].values())  # metric x sign (mode max: the metric itself), run order
    for i, row in enumerate(rows):
        cutoff = np.nanpercentile(values[:i], (1 - 1 / 3) * 100) if i else None  # reduction_factor 3
        expected = "stopped early" if cutoff is not None and values[i] < cutoff else "completed"
        assert row["status"] == expected, (row, values, cutoff)
        assert int(row["epochs"]) == (1 if expected == "stopped early" else EPOCHS), row
    stopped = [r for r in rows if r["status"] == "stopped early"]
    assert resumed_sweep["summary"]["status_counts"]["stopped early"] == len(stopped)
    best = max(rows, key=lambda r: float(r["harmonic/r@1"]))
    assert resumed_sweep["summary"]["best"]["params"]["optim.lr"] == float(best["optim.lr"]) == GOOD_LR


@SWEEP_BUDGET
def test_the_sweep_pushed_its_trials_by_state(resumed_sweep, setup):
    """The Pushgateway holds the end of the resumed run: every trial started, each finished or pruned
    as the results say (the trials restored from the killed run counted too)."""
    rows = resumed_sweep["rows"]
    pushed = {s[1]["state"]: s[2] for s in setup["gateway"].samples("puma_sweep_trials")
              if s[1]["sweep"] == "tiny"}
    assert pushed == {"started": NUM_SAMPLES, "finished": sum(r["status"] == "completed" for r in rows),
                      "pruned": sum(r["status"] == "stopped early" for r in rows), "failed": 0}
    assert used_by_monitoring("puma_sweep_") <= {n for n, _, _ in setup["gateway"].samples()}


@SWEEP_BUDGET
def test_results_table_plots_and_best_config(resumed_sweep, setup):
    results, rows, summary = resumed_sweep["results"], resumed_sweep["rows"], resumed_sweep["summary"]
    best_value = max(float(r["harmonic/r@1"]) for r in rows)
    assert summary["metric"] == "harmonic/r@1" and summary["split"] == "val"
    assert summary["best"]["objective"] == pytest.approx(best_value)
    table = (results / "trials.md").read_text()
    assert table.count("\n") == NUM_SAMPLES + 2 and summary["best"]["trial_id"] in table.splitlines()[2]
    for name in ("optimization_history.png", "param_importances.png"):
        data = (results / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    best = load_config(results / "best_config.yaml")  # as jobs/train.py loads it
    for key, value in summary["best"]["params"].items():
        section, *rest = key.split(".")
        node = getattr(best, section)
        for part in rest:
            node = getattr(node, part)
        assert node == value, key
    assert (best.train.eval_split, best.data.val_fraction) == ("test", 0.0)  # final training: all classes
    assert best.train.run_name == "tiny-best"


def _flat(tree: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


@SWEEP_BUDGET
def test_best_config_is_the_base_with_the_best_values_and_passes_the_training_jobs_checks(resumed_sweep,
                                                                                         setup):
    """best_config.yaml, read the way jobs/train.py reads it, is the sweep's base config with the best
    trial's values and its own run name (not the trials' validation carve-out or run folders), and passes
    every check jobs/train.py makes on its driver before Ray starts: the model, the method's loss, the
    optimiser and its schedule build from it. (Training from a config file runs in every other job test;
    this test trained it once more, 50 s of CI, before.)"""
    from puma.train.driver import check_inputs

    best = load_config(str(resumed_sweep["results"] / "best_config.yaml"))
    params = resumed_sweep["summary"]["best"]["params"]
    assert set(params) == set(TEST_SPACE)
    base = _flat(to_dict(load_config(str(setup["config"]))))
    tuned = _flat(to_dict(best))
    changed = {k for k in base if k.split(".")[0] != "sweep" and tuned[k] != base[k]}
    assert changed <= {*params, "train.run_name"}, changed
    for key, value in params.items():
        assert tuned[key] == pytest.approx(value), key
    assert tuned["train.run_name"] == "tiny-best"
    check_inputs(best)


@SWEEP_BUDGET
def test_resume_with_other_settings_is_refused(resumed_sweep, setup):
    changed = load_config(setup["config"], ["train.epochs=3", f"sweep.space_file={setup['space']}"])
    with pytest.raises(SweepError, match=r"other settings; changed: .*'config.train.epochs: 2 -> 3'"):
        plan_sweep(changed)
    with pytest.raises(SweepError, match="exists and sweep.resume=false"):
        plan_sweep(load_config(setup["config"], ["sweep.resume=false", f"sweep.space_file={setup['space']}"]))


def test_a_config_key_added_since_the_sweep_started_keeps_it_resumable_at_its_default():
    """A sweep started by an older version lacks keys added since: at their defaults they change nothing."""
    from puma.config import Config, to_dict
    from puma.sweep.run import _diff

    defaults = {"config": to_dict(Config())}
    now = {"config": to_dict(Config()), "space": {"optim.lr": {"type": "grid", "values": [1e-4]}}}
    started = copy.deepcopy(now)
    del started["config"]["train"]["placement_strategy"], started["config"]["data"]["deterministic"]
    assert _diff(started, now, defaults=defaults) == []
    now["config"]["train"]["placement_strategy"] = "SPREAD"
    assert _diff(started, now, defaults=defaults) == ["config.train.placement_strategy: None -> 'SPREAD'"]
    now["config"]["train"]["placement_strategy"], now["config"]["train"]["epochs"] = "PACK", 3
    assert _diff(started, now, defaults=defaults) == ["config.train.epochs: 100 -> 3"]


# ----------------------------------------------------------------------------- placement groups


class _Trial:
    def __init__(self, status: str) -> None:
        self.status = status


def test_worker_groups_that_stopped_trials_leave_are_given_back(ray_cluster):
    """Ray's own cleaner cannot see the controller die without the State API (this cluster has no
    dashboard): the callback removes worker-shaped groups once no other trial runs, nothing else."""
    from ray.util.placement_group import placement_group, placement_group_table

    from puma.sweep.placement import ReleaseStoppedTrainGroups

    cfg = load_config(None, ["train.num_workers=2", "train.cpus_per_worker=0.5"])
    release = ReleaseStoppedTrainGroups.for_config(cfg)
    leaked = placement_group([{"CPU": 0.5}, {"CPU": 0.5}])  # what a killed controller leaves
    other = placement_group([{"CPU": 0.25}])  # e.g. Tune's own trial group
    ray_cluster.get([leaked.ready(), other.ready()], timeout=60)
    ended = _Trial("TERMINATED")

    def state(pg) -> str:
        return placement_group_table()[pg.id.hex()]["state"]

    release.on_trial_complete(0, [ended, _Trial("RUNNING")], ended)  # another run may own it: kept
    assert state(leaked) == "CREATED" and release.released == 0
    release.on_trial_complete(0, [ended, _Trial("TERMINATED")], ended)
    assert state(leaked) == "REMOVED" and state(other) == "CREATED" and release.released == 1
    ray_cluster.util.remove_placement_group(other)
