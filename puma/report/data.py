"""The numbers of a report: the checkpoint, its metrics through the index (as jobs/evaluate.py computes
them), the zero-shot baseline and history the run recorded, other runs, a sweep, a few-shot table.

Sources, each read through ``puma.storage``:

- this run: ``run_evaluation`` over the index at ``--index`` (embedding the test split first when
  the index does not exist yet), so the numbers equal ``jobs/evaluate.py``'s on that index;
- zero-shot: the frozen backbone's metrics the run recorded before training (``RunState.before`` in
  the checkpoint's meta, else in the run's newest complete checkpoint);
- history: ``RunState.history`` (one entry per epoch: ``train/loss``, metrics when evaluated);
- other runs (``--compare``): the metrics their best checkpoint recorded (``meta.json``);
- a sweep: its ``trials.csv`` (``puma.sweep.report.trials_csv``): keep probability against the
  objective, the fourth column;
- few-shot: ``{"rows": [{"method", "shots", "harmonic_r1_mean", "harmonic_r1_std"}, ...]}``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from puma import console, storage
from puma.checkpoint import (
    checkpoint_id,
    configured_checkpoint,
    has_checkpoint,
    newest_complete,
    read_meta,
    resolve_checkpoint,
)
from puma.config import Config
from puma.errors import UserError
from puma.eval.index_eval import run_evaluation
from puma.index.manifest import read_manifest
from puma.index.versions import live_manifest, resolve
from puma.run_folder import RunFolder

KEEP_PROB = "model.adapter.keep_prob"  # the sweep column the keep-probability curve plots
OBJECTIVE_COLUMN = 3  # trials.csv: trial_id, status, epochs, <objective>, <tuned keys>... (puma.sweep.report)
METRIC_KEY = re.compile(r"^(?P<name>[^/]+)/(?P<metric>r@\d+|map@r|rp)$")
NOT_DATASETS = {"before", "best", "run", "train", "lr", "init"}
FEWSHOT_FIELDS = ("method", "shots", "harmonic_r1_mean", "harmonic_r1_std")


class ReportInputError(UserError, ValueError):
    """Something the report was pointed at is missing or unreadable (says what, where, what to do)."""


class NoRunError(ReportInputError):
    """No trained run (no checkpoint) where the report looked."""


class SweepFileError(ReportInputError):
    """A sweep results folder without a readable trials.csv holding the keep-probability column."""


class FewShotFileError(ReportInputError):
    """A few-shot results file that exists but is not the expected JSON."""


@dataclass
class ReportOptions:
    """What jobs/report.py's options choose ('' = the default)."""

    checkpoint: str = ""  # default embed.checkpoint, else <run>/best
    index: str = ""  # default index.uri
    compare: list[str] = field(default_factory=list)  # other run folders
    sweep: str = ""  # a sweep's results folder (trials.csv)
    out: str = ""  # default <run>/report
    fewshot: str = ""  # few-shot results JSON ('' or absent: the section is a note)
    queries: int = 4  # retrieval grid rows per dataset
    k: int = 6  # results per grid row
    tsne_points: int = 1500  # points of the unified 2-D map

    def __post_init__(self) -> None:
        for name in ("queries", "k", "tsne_points"):
            if int(getattr(self, name)) < 1:
                raise ReportInputError(f"--{name.replace('_', '-')} must be at least 1, got "
                                       f"{getattr(self, name)}")


@dataclass
class Evaluation:
    """The run's metrics through the index, and how they were obtained."""

    metrics: dict[str, float]
    index: str
    items: int
    model_id: str
    record_uri: str  # run_evaluation's JSON
    embedded: int = 0  # test images embedded by this report (0: the index was there)


# ----------------------------------------------------------------------------- the checkpoint


def find_checkpoint(cfg: Config, checkpoint: str, run: str) -> str:
    """The checkpoint version folder to report on (``checkpoint``, embed.checkpoint, else <run>/best)."""
    uri = configured_checkpoint(cfg, checkpoint or None)
    if has_checkpoint(uri):
        return resolve_checkpoint(uri)
    if checkpoint or cfg.embed.checkpoint:
        raise NoRunError(f"no checkpoint at {uri} (no meta.json or best/current.json there); pass "
                         "--checkpoint a checkpoint folder that jobs/train.py wrote")
    raise NoRunError(f"no trained run at {run}: {uri} holds no checkpoint; train first (python "
                     "jobs/train.py with the same config and overrides) or pass --checkpoint URI")


def header_facts(meta: dict[str, Any]) -> dict[str, Any]:
    """Commit of this checkout ('' when unknown) and the library versions the checkpoint recorded."""
    return {"commit": git_commit(), "versions": dict(meta.get("versions", {}))}


def git_commit(repo: Path | None = None) -> str:
    """``git rev-parse HEAD`` of the repository holding puma ('' when git or the repository is absent)."""
    repo = repo or Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


# ----------------------------------------------------------------------------- this run's metrics


def evaluate_run(cfg: Config, index: str, checkpoint: str, out: str) -> Evaluation:
    """Embed the test split when the index does not exist yet (as jobs/evaluate.py), then evaluate it."""
    from puma.inference import embed_catalogue

    model_id = checkpoint_id(checkpoint)
    embedded = 0
    if live_manifest(index) is not None:
        check_index_model(index, model_id, checkpoint)
    else:
        console.say(f"embedding the test split of {cfg.data.uri} into {index}")
        report = embed_catalogue(cfg, cfg.data.uri, index_uri=index, checkpoint=checkpoint, split="test")
        console.say(f"embedded {report.embedded} test images ({report.rejected} rejected, "
                    f"{report.total} in the index)")
        embedded = report.embedded
    items = read_manifest(resolve(index)).total
    console.say(f"evaluating {items} items through the index at {index} (index.nprobe={cfg.index.nprobe})")
    metrics, record = run_evaluation(index, cfg.index, cfg.eval.ks, storage.join(out, "evaluation.json"),
                                     cfg.eval.query_chunk)
    return Evaluation(metrics, index, items, model_id, record, embedded)


def check_index_model(index: str, model_id: str, checkpoint: str) -> None:
    """Refuse an index of another model: its numbers would not be this checkpoint's."""
    found = read_manifest(resolve(index)).model_id
    if found and found != model_id:
        raise ReportInputError(f"index {index} holds embeddings of model {found}, not of checkpoint "
                               f"{checkpoint} ({model_id}); pass --index a new folder (the report embeds "
                               "the test split there) or --checkpoint the index's own model")


# ----------------------------------------------------------------------------- what the run recorded


def recorded_run(run: str, meta: dict[str, Any]) -> tuple[dict[str, float], list[dict[str, float]]]:
    """(zero-shot metrics, per-epoch history): the checkpoint's run state, completed from the run's
    newest complete checkpoint (zero-shot when the checkpoint lacks it, a longer history)."""
    state = meta.get("run_state") or {}
    before, history = dict(state.get("before") or {}), list(state.get("history") or [])
    newest = newest_complete(run)  # None for a run folder without checkpoints (or none at all)
    if newest is not None:
        other = read_meta(newest.uri).get("run_state") or {}
        before = before or dict(other.get("before") or {})
        if len(other.get("history") or []) > len(history):
            history = list(other["history"])
    return before, history


def metric_values(metrics: dict[str, Any]) -> dict[str, float]:
    """The per-dataset, unified and harmonic retrieval metrics of a metrics dict (no loss, lr, before/...)."""
    out = {}
    for key, value in metrics.items():
        found = METRIC_KEY.match(key)
        if found and found["name"] not in NOT_DATASETS and isinstance(value, (int, float)):
            out[key] = float(value)
    return out


def compare_runs(runs: list[str]) -> dict[str, dict[str, float]]:
    """Name -> the metrics each run's best checkpoint recorded (names: the run folders' names)."""
    out: dict[str, dict[str, float]] = {}
    for run in runs:
        folder = RunFolder(run)
        best = folder.best
        if not has_checkpoint(best):
            raise NoRunError(f"--compare {run}: no best checkpoint at {best}; name a run folder that "
                             "jobs/train.py wrote (<train.storage_path>/<train.run_name>)")
        name = folder.name
        while name in out or name in ("zero-shot", "this run"):
            name += "'"
        out[name] = metric_values(read_meta(best).get("metrics", {}))
    return out


# ----------------------------------------------------------------------------- sweep and few-shot files


@dataclass
class SweepCurve:
    """Keep probability against the objective, one point per trial that reported both."""

    objective: str
    keep_prob: list[float]
    values: list[float]
    completed: list[bool]  # False: stopped early (ASHA), scored after fewer epochs
    source: str


def sweep_file(uri: str) -> str:
    """trials.csv of a results folder (or the CSV itself)."""
    return uri if uri.endswith(".csv") else storage.join(uri, "trials.csv")


def read_sweep(uri: str) -> SweepCurve:
    """The keep-probability curve of a sweep's results (SweepFileError when it cannot be read)."""
    path = sweep_file(uri)
    try:
        text = storage.read_text(path)
    except FileNotFoundError as exc:
        raise SweepFileError(f"--sweep {uri}: no {path}; pass a sweep's results folder "
                             "(<sweep.storage_path>/<sweep.name>/results) holding trials.csv") from exc
    except UnicodeDecodeError as exc:
        raise SweepFileError(f"--sweep {uri}: {path} is not a text CSV file ({exc})") from exc
    reader = csv.reader(io.StringIO(text))
    header = next(reader, [])
    if KEEP_PROB not in header or len(header) <= OBJECTIVE_COLUMN:
        raise SweepFileError(f"--sweep {uri}: {path} has no column {KEEP_PROB} (columns: {header}); "
                             "pass a sweep that tuned the keep probability")
    return _sweep_points(list(reader), header, path)


def _sweep_points(rows: list[list[str]], header: list[str], path: str) -> SweepCurve:
    """Parse the keep-probability and objective cells; trials without both are left out."""
    keep, objective = header.index(KEEP_PROB), OBJECTIVE_COLUMN
    status = header.index("status") if "status" in header else None
    curve = SweepCurve(header[objective], [], [], [], path)
    for line, row in enumerate(rows, start=2):
        if len(row) != len(header):
            raise SweepFileError(f"{path} line {line}: {len(row)} cells, the header has {len(header)}")
        cells = (row[keep].strip(), row[objective].strip())
        try:
            x, y = (float(c) if c else math.nan for c in cells)
        except ValueError as exc:
            raise SweepFileError(f"{path} line {line}: not a number in {KEEP_PROB} or "
                                 f"{header[objective]} ({exc})") from exc
        if math.isfinite(x) and math.isfinite(y):
            curve.keep_prob.append(x)
            curve.values.append(y)
            curve.completed.append(status is None or row[status].strip() == "completed")
    if not curve.values:
        raise SweepFileError(f"{path}: no trial reported both {KEEP_PROB} and {header[objective]}")
    return curve


def read_fewshot(uri: str) -> list[dict[str, Any]] | None:
    """The few-shot rows, or None when there is no file (FewShotFileError when it is malformed)."""
    if not uri or not storage.exists(uri):
        return None
    try:
        rows = json.loads(storage.read_text(uri))["rows"]
        out = [{"method": str(r["method"]), "shots": int(r["shots"]),
                "harmonic_r1_mean": float(r["harmonic_r1_mean"]),
                "harmonic_r1_std": float(r.get("harmonic_r1_std", 0.0))} for r in rows]
    except (ValueError, KeyError, TypeError) as exc:
        raise FewShotFileError(f"{uri} is not a few-shot results file ({type(exc).__name__}: {exc}); "
                               f"expected {{\"rows\": [{{{', '.join(FEWSHOT_FIELDS)}}}, ...]}}") from exc
    return sorted(out, key=lambda r: (r["method"], r["shots"])) or None
