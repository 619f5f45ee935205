"""Kill a training run at chosen moments and audit what it left behind (import as ``kill_harness``).

Used by tests/test_train_job.py (the CI test) and bench/stress_recovery.py (the 20x stress run).

- ``Watcher`` polls the run folder and records every checkpoint folder the moment it is complete
  (meta.json present and every file matching its sha256), with its epoch and attempt.
- ``run_lineage`` starts ``jobs/train.py`` and, for each ``Kill``, waits for the next complete
  checkpoint, then SIGKILLs the driver or one Ray Train worker right away (``moment="checkpoint"``:
  complete on storage, maybe not yet registered by Ray, best/ not yet published) or part-way into the
  next epoch (``moment="mid-epoch"``); a killed driver is started again with the same command. A
  ``checkpoint`` kill lands there whatever the machine's load: rank 0 holds at that moment
  (``PUMA_FAULT_HOLD``, puma/faults.py) until the harness has killed, and the hold is lifted for the
  checkpoints no kill waits on (a tiny epoch takes a fraction of a second: without the hold a loaded
  machine's kill landed after the next epoch, or after the run, had ended).
- ``audit`` lists everything the run got wrong (an empty list is a pass): an epoch written again at
  or below the newest complete one, attempts that did not continue from the newest complete
  checkpoint, history, counters, retention, and whether best/ holds the run's best model.

Two launchers: ``cluster_launcher`` (a `ray start --head` cluster that outlives the driver, as
`ray job submit` runs it; killing the driver kills only the driver) and ``local_launcher`` (the job
starts its own local Ray; killing the driver kills its whole process group, Ray included).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from puma.checkpoint import CheckpointError, best_record, load_model, read_checkpoint

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
RESUMED = re.compile(r"resumed from (\S+) after epoch (\d+) \(attempt (\d+)\)")


# ----------------------------------------------------------------------------- watching the run folder


@dataclass
class Event:
    """A checkpoint folder seen complete."""

    time: float
    name: str
    epoch: int
    attempt: int


class Watcher:
    """Polls ``run_dir`` (every ``interval`` s) and records each checkpoint folder once it is complete."""

    def __init__(self, run_dir: Path, interval: float = 0.02):
        self.run_dir, self.interval = Path(run_dir), interval
        self.events: list[Event] = []
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()  # anything completed since the last poll

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._poll()
            time.sleep(self.interval)

    def _poll(self) -> None:
        for folder in sorted(p for p in self.run_dir.glob("checkpoint_*") if p.is_dir()):
            if folder.name in self._seen or not (folder / "meta.json").exists():
                continue
            try:
                state = read_checkpoint(str(folder), with_optimizer=True)  # every file against its sha256
            except (CheckpointError, OSError):
                continue  # still being written (or removed while we read): look again next time
            self._seen.add(folder.name)
            self.events.append(Event(time.monotonic(), folder.name, int(state.meta["epoch"]),
                                     int(state.meta["run_state"].get("attempt", 0))))

    def wait_for_new(self, count: int, driver: subprocess.Popen, timeout: float) -> Event | None:
        """Block until more than ``count`` events exist; None if the driver exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.events) > count:
                return self.events[count]
            if driver.poll() is not None:
                return None
            time.sleep(0.01)
        raise AssertionError(f"no new complete checkpoint within {timeout:.0f}s")


# ----------------------------------------------------------------------------- launching and killing


def _descendants(root: int) -> set[int]:
    """PIDs whose parent chain reaches ``root`` (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier and pid not in found}
        found |= frontier
    return found


def train_workers(root: int) -> list[int]:
    """Live Ray Train worker processes below ``root`` (a local driver, or a `ray start --head` process)."""
    pids = []
    for pid in sorted(_descendants(root)):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::RayTrainWorker"):
                pids.append(pid)
        except OSError:
            continue
    return pids


@dataclass
class Launcher:
    """How drivers start and die: on a cluster that outlives them, or with a job-owned local Ray."""

    kind: str  # "cluster" | "local"
    env: dict
    head_pid: int | None = None  # the `ray start --head` process (cluster)

    def start(self, config: Path, log: Path) -> subprocess.Popen:
        """``python jobs/train.py --config FILE`` in a session of its own, output to ``log``."""
        env = dict(self.env)
        if self.kind == "local":  # a fresh Ray temp dir per driver: nothing shared with a killed one
            env["PUMA_RAY_TMP"] = os.path.join(self.env["PUMA_RAY_TMP"], log.stem)
        with open(log, "w") as out:
            command = [PYTHON, "jobs/train.py", "--config", str(config)]
            return subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def kill_driver(self, driver: subprocess.Popen) -> None:
        """SIGKILL the driver (cluster: Ray stays) or its whole process group (local: Ray goes with it)."""
        if self.kind == "cluster":
            driver.send_signal(signal.SIGKILL)
        else:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()

    def workers(self, driver: subprocess.Popen) -> list[int]:
        return train_workers(self.head_pid if self.kind == "cluster" else driver.pid)


def cluster_launcher(address: str, env: dict, head_pid: int) -> Launcher:
    """Drivers that join the cluster at ``address`` (``RAY_ADDRESS``), as `ray job submit` runs them."""
    return Launcher("cluster", dict(env, RAY_ADDRESS=address, PYTHONUNBUFFERED="1"), head_pid)


def local_launcher(ray_tmp: Path) -> Launcher:
    """Drivers that start their own local Ray (temp dir ``ray_tmp``), as `python jobs/train.py` does."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return Launcher("local", dict(env, PUMA_RAY_TMP=str(ray_tmp), PYTHONUNBUFFERED="1"))


@dataclass
class Kill:
    """What to kill after the next complete checkpoint, and when."""

    target: str  # "driver" | "worker"
    moment: str = "checkpoint"  # "checkpoint": right after it completes | "mid-epoch": part-way into the next


@dataclass
class Lineage:
    """What a killed-and-resumed run did."""

    kills: list[dict] = field(default_factory=list)  # what was killed, when, after which epoch
    events: list[Event] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    returncode: int | None = None
    seconds: float = 0.0
    start_failures: int = 0  # drivers that died before training started (started again, not kills)
    records_at_start: int = 0  # attempt records when the current driver started
    timeline: list[tuple[int, int, float]] = field(default_factory=list)  # (epoch, attempt, s from start)

    def output(self) -> str:
        return "\n".join(log.read_text(errors="replace") for log in self.logs if log.exists())


def run_lineage(launcher: Launcher, config: Path, run_dir: Path, kills: list[Kill], log_dir: Path,
                timeout: float = 600, rng: random.Random | None = None) -> Lineage:
    """Run training, applying ``kills`` in order, then let the last driver finish."""
    rng = rng or random.Random(0)
    start, lineage = time.monotonic(), Lineage()
    gate = Path(log_dir) / "hold-at-checkpoint"
    hold_env = {"PUMA_FAULT_HOLD": f"train.checkpoint:{gate}"}
    launcher = dataclasses.replace(launcher, env=dict(launcher.env, **hold_env))
    _hold(gate, bool(kills) and kills[0].moment == "checkpoint")
    watcher = Watcher(run_dir).start()
    driver = _start(launcher, config, run_dir, log_dir, lineage)
    try:
        for n, kill in enumerate(kills):
            event = watcher.wait_for_new(len(watcher.events), driver, timeout)
            while event is None:  # the driver exited before the checkpoint the kill waits for
                driver = _restart_failed_start(launcher, config, run_dir, log_dir, lineage, driver)
                event = watcher.wait_for_new(len(watcher.events), driver, timeout)
            delay = 0.0
            if kill.moment == "mid-epoch":
                delay = rng.uniform(0.3, 0.7) * _epoch_seconds(watcher.events)
                time.sleep(delay)
            _kill(launcher, kill, driver)
            lineage.kills.append({"target": kill.target, "moment": kill.moment, "after_epoch": event.epoch,
                                  "at_s": round(time.monotonic() - start, 1), "delay_s": round(delay, 3),
                                  "newest_complete": max(e.epoch for e in watcher.events)})
            _hold(gate, n + 1 < len(kills) and kills[n + 1].moment == "checkpoint")
            if kill.target == "driver":
                driver = _start(launcher, config, run_dir, log_dir, lineage)
        while driver.wait(timeout=timeout) != 0:
            driver = _restart_failed_start(launcher, config, run_dir, log_dir, lineage, driver)
        lineage.returncode = 0
    finally:
        _hold(gate, False)
        if driver.poll() is None:
            launcher.kill_driver(driver)
        watcher.stop()
        lineage.events, lineage.seconds = watcher.events, time.monotonic() - start
        lineage.timeline = [(e.epoch, e.attempt, round(e.time - start, 1)) for e in watcher.events]
    return lineage


def _hold(gate: Path, on: bool) -> None:
    """Rank 0 of the run holds at each complete checkpoint while ``gate`` exists (puma/faults.py)."""
    if on:
        gate.touch()
    else:
        gate.unlink(missing_ok=True)


def _start(launcher: Launcher, config: Path, run_dir: Path, log_dir: Path,
           lineage: Lineage) -> subprocess.Popen:
    log = Path(log_dir) / f"driver_{len(lineage.logs) + 1}.log"
    lineage.logs.append(log)
    lineage.records_at_start = len(attempt_records(run_dir))
    return launcher.start(config, log)


def _restart_failed_start(launcher: Launcher, config: Path, run_dir: Path, log_dir: Path, lineage: Lineage,
                          driver: subprocess.Popen, limit: int = 3) -> subprocess.Popen:
    """Start again a driver that failed before its training started (no attempt recorded: e.g. its Ray
    timed out at startup on a loaded machine), at most ``limit`` times; anything else is a failure."""
    started_training = len(attempt_records(run_dir)) > lineage.records_at_start
    if started_training or lineage.start_failures >= limit:
        when = "during training" if started_training else f"at startup {limit + 1} times"
        raise AssertionError(f"the driver exited with {driver.returncode} {when}:\n"
                             f"{lineage.logs[-1].read_text(errors='replace')[-3000:]}")
    lineage.start_failures += 1
    return _start(launcher, config, run_dir, log_dir, lineage)


def _kill(launcher: Launcher, kill: Kill, driver: subprocess.Popen) -> None:
    if kill.target == "driver":
        launcher.kill_driver(driver)
        return
    workers = launcher.workers(driver)
    if not workers:
        raise AssertionError("no live Ray Train worker to kill")
    os.kill(random.choice(workers), signal.SIGKILL)


def _epoch_seconds(events: list[Event]) -> float:
    """The last gap between two consecutive complete checkpoints of one attempt (1 s if none yet)."""
    for a, b in zip(reversed(events[:-1]), reversed(events), strict=False):
        if a.attempt == b.attempt:
            return b.time - a.time
    return 1.0


# ----------------------------------------------------------------------------- auditing


def complete_checkpoints(run_dir: Path) -> list[dict]:
    """Every complete checkpoint folder left in the run folder: name, epoch, attempt."""
    out = []
    for folder in sorted(p for p in Path(run_dir).glob("checkpoint_*") if p.is_dir()):
        try:
            meta = read_checkpoint(str(folder)).meta
        except CheckpointError:
            continue
        out.append({"name": folder.name, "epoch": meta["epoch"], "attempt": meta["run_state"]["attempt"]})
    return out


def attempt_records(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((Path(run_dir) / "attempts").glob("attempt_*.json"))]


def audit(run_dir: Path, lineage: Lineage, epochs: int, keep: int, metric: str) -> list[str]:
    """Everything the run got wrong; [] when it continued from the newest complete checkpoint every time."""
    problems = []
    if lineage.returncode != 0:
        return [f"the last driver exited with {lineage.returncode}: {lineage.output()[-3000:]}"]
    newest = 0
    for event in lineage.events:  # in the order they completed
        if event.epoch != newest + 1:
            problems.append(f"{event.name} wrote epoch {event.epoch} after epoch {newest} was complete")
        newest = max(newest, event.epoch)
    folders = complete_checkpoints(run_dir)
    problems += _audit_retention(run_dir, folders, epochs, keep)
    if len([p for p in Path(run_dir).glob("checkpoint_*") if p.is_dir()]) != len(folders):
        problems.append("incomplete checkpoint folders were left behind")
    problems += _audit_attempts(run_dir, lineage)
    metas = [read_checkpoint(str(Path(run_dir) / f["name"])).meta for f in folders]
    final = max(metas, key=lambda m: m["epoch"], default=None)
    if final is None:
        return problems + ["no complete checkpoint left"]
    problems += _audit_state(final["run_state"], epochs, len(lineage.kills))
    problems += _audit_best(run_dir, final["run_state"]["history"], metric)
    return problems


def registered_names(run_dir: Path) -> set[str]:
    """The checkpoint folders Ray Train's snapshot names (the ones its own retention manages)."""
    snapshot = Path(run_dir) / "checkpoint_manager_snapshot.json"
    if not snapshot.is_file():
        return set()
    return {r["checkpoint_dir_name"] for r in json.loads(snapshot.read_text()).get("checkpoint_results", [])}


def _audit_retention(run_dir: Path, folders: list[dict], epochs: int, keep: int) -> list[str]:
    """The newest ``keep`` epochs are left; any other folder is one Ray registered (Ray's to remove: a
    folder its snapshot names must stay), at most ``keep`` of those; none that Ray never registered."""
    newest = list(range(1, epochs + 1))[-keep:]
    registered = registered_names(run_dir)
    left = sorted(f["epoch"] for f in folders)
    unregistered_old = sorted(f["epoch"] for f in folders
                              if f["epoch"] not in newest and f["name"] not in registered)
    problems = []
    if not set(newest) <= set(left) or unregistered_old or len(registered) > keep:
        problems.append(f"checkpoint folders left {left}, expected {newest} plus at most {keep} that Ray's "
                        f"snapshot names (train.checkpoints_to_keep={keep}); never registered: "
                        f"{unregistered_old}; registered: {sorted(registered)}")
    return problems


def _audit_attempts(run_dir: Path, lineage: Lineage) -> list[str]:
    """Attempt k continued from the newest complete checkpoint of attempts before it, and said so."""
    problems, records = [], attempt_records(run_dir)
    if [r["attempt"] for r in records] != list(range(1, len(lineage.kills) + 2)):
        problems.append(f"attempts recorded {[r['attempt'] for r in records]}, "
                        f"expected 1..{len(lineage.kills) + 1}")
    said = {int(m.group(3)): int(m.group(2)) for m in RESUMED.finditer(lineage.output())}
    for record in records[1:]:
        before = [e.epoch for e in lineage.events if e.attempt < record["attempt"]]
        newest = max(before, default=0)
        if record["after_epoch"] != newest:
            problems.append(f"attempt {record['attempt']} continued after epoch {record['after_epoch']}, "
                            f"but epoch {newest} was complete")
        if said.get(record["attempt"]) != record["after_epoch"]:
            problems.append(f"attempt {record['attempt']}: no line 'resumed from ... after epoch "
                            f"{record['after_epoch']} (attempt {record['attempt']})' in the driver output")
    return problems


def _audit_state(run_state: dict, epochs: int, kills: int) -> list[str]:
    problems, history = [], run_state["history"]
    if [int(h["epoch"]) for h in history] != list(range(1, epochs + 1)):
        problems.append(f"history epochs {[int(h['epoch']) for h in history]}")
    steps = [h["step"] for h in history]
    if steps != sorted(steps) or len(set(steps)) != len(steps):
        problems.append(f"history steps {steps} do not increase")
    attempts = [int(h["attempt"]) for h in history]
    if attempts != sorted(attempts) or attempts[0] != 1:
        problems.append(f"history attempts {attempts}")
    if run_state["resumes"] != kills or run_state["recomputed_epochs"] != 0:
        problems.append(f"resumes {run_state['resumes']} (expected {kills}), recomputed epochs "
                        f"{run_state['recomputed_epochs']} (expected 0)")
    if not run_state["before"]:
        problems.append("the zero-shot metrics were lost")
    return problems


def _audit_best(run_dir: Path, history: list[dict], metric: str) -> list[str]:
    """best/ holds the first epoch with the highest ``metric`` of the run, complete and loadable."""
    values = [h.get(metric, float("-inf")) for h in history]
    best_epoch = int(history[values.index(max(values))]["epoch"])
    record = best_record(str(Path(run_dir) / "best"), metric)
    if record is None or record["epoch"] != best_epoch or record["value"] != max(values):
        return [f"best/ holds {record and (record['epoch'], record['value'])}, the run's best is epoch "
                f"{best_epoch} ({max(values)})"]
    try:
        load_model(str(Path(run_dir) / "best"))  # every file against its sha256, probe reproduced
    except CheckpointError as exc:
        return [f"best/ does not load: {exc}"]
    versions = [p for p in (Path(run_dir) / "best").iterdir() if p.is_dir()]
    return [] if len(versions) <= 2 else [f"best/ keeps {len(versions)} versions"]
