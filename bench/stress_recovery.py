"""Stress the recovery of training runs: kill them at the worst moments, many times, and audit.

    .venv/bin/python bench/stress_recovery.py                          # 20 repetitions, cluster and local
    .venv/bin/python bench/stress_recovery.py --repeats 2 --modes local

Every repetition trains the tests' tiny PUMA model on 48 real Oxford-Flowers photos (5 epochs,
``train.checkpoints_to_keep=2``) and kills it twice, each time after the next checkpoint completes:
once the driver and once a Ray Train worker (chosen at random when there are two), one of them right
away (complete on storage, not yet registered by Ray: the worst moment) and the other part-way into
the next epoch. Even repetitions kill the driver right away and the worker mid-epoch, odd ones the
worker right away and the driver mid-epoch; the worker count runs 1, 1, 2, 2, ... so each pairing
meets both. A killed driver is started again with the same command. Modes: ``cluster``, a
`ray start --head` cluster that outlives its drivers (killing the driver kills only it), and
``local``, drivers that start their own Ray (killing the driver kills its process group).

A repetition passes when tests/kill_harness.audit finds nothing: no epoch written at or below the
newest complete one, every attempt continued after the newest complete epoch and said so, history
1..E with rising steps, resumes == kills and 0 epochs recomputed, the newest two checkpoint folders
left and no others but those Ray's snapshot names (Ray's retention; never one Ray did not register),
best/ holding the run's best model (complete, probe reproduced). A driver that dies
before its training starts (its Ray timing out at startup on a loaded machine) is started again
and counted apart. Results: bench/results/stress_recovery.json and .md (machine, commit, each run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the kill harness and the tiny model live with the tests

import yaml  # noqa: E402
from kill_harness import Kill, audit, cluster_launcher, local_launcher, run_lineage  # noqa: E402
from tiny import TINY_BACKBONE  # noqa: E402

from puma.data.prepare import prepare  # noqa: E402
from puma.data.sources import SourceSpec  # noqa: E402

FLOWERS = REPO.parent / "shared" / "data" / "flowers12-subset"
KILL_SETS = ([Kill("driver", "checkpoint"), Kill("worker", "mid-epoch")],
             [Kill("worker", "checkpoint"), Kill("driver", "mid-epoch")])
EPOCHS, KEEP, METRIC = 5, 2, "harmonic/r@1"
RESULTS = REPO / "bench" / "results"


def prepare_data(root: Path) -> str:
    """6 Oxford-Flowers species x 8 photos, prepared to Parquet (3 train / 3 test classes)."""
    photos = root / "flowers"
    for species in sorted(p for p in FLOWERS.iterdir() if p.is_dir())[:6]:
        (photos / species.name).mkdir(parents=True)
        for photo in sorted(species.glob("*.jpg"))[:8]:
            shutil.copy(photo, photos / species.name / photo.name)
    out = str(root / "prepared")
    prepare([SourceSpec("folder", "flowers", str(photos))], out, log=lambda _: None)
    return out


def write_config(path: Path, data: str, runs: str, workers: int) -> Path:
    cfg = {"model": {"backbone": dict(TINY_BACKBONE), "adapter": {"rank": 8},
                     "prompt_pool": {"pool_size": 4, "length": 2}, "head": {"embed_dim": 16}},
           "data": {"uri": data, "preset": "", "decode_batch_size": 8},
           "train": {"epochs": EPOCHS, "batch_size": 8, "num_workers": workers, "cpus_per_worker": 0.5,
                     "storage_path": runs, "run_name": "run", "max_failures": 4, "checkpoints_to_keep": KEEP},
           "eval": {"batch_size": 32}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_head(temp: Path) -> tuple[subprocess.Popen, str, dict]:
    """`ray start --head --block` on loopback with token auth; returns (process, GCS address, env)."""
    ray_bin = str(Path(sys.executable).parent / "ray")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    gcs = _free_port()
    agents = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
              "runtime-env-agent-port")
    command = [ray_bin, "start", "--head", "--block", f"--port={gcs}", "--node-ip-address=127.0.0.1",
               "--include-dashboard=false", "--num-cpus=4", f"--temp-dir={temp}", "--disable-usage-stats",
               *[f"--{name}={_free_port()}" for name in agents]]
    head = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    time.sleep(15)  # GCS and raylet up; a driver that comes too early retries its connection anyway
    if head.poll() is not None:
        raise RuntimeError("ray start --head exited early")
    return head, f"127.0.0.1:{gcs}", env


def stop_head(head: subprocess.Popen) -> None:
    """Signal the head's own process group (never `ray stop`: it would stop every Ray on the machine)."""
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()


def repetition(mode: str, index: int, workers: int, data: str, root: Path, head) -> dict:
    """One run killed twice (KILL_SETS, alternating), then audited."""
    rep = root / f"{mode}_{index:02d}"
    rep.mkdir()
    config = write_config(rep / "tiny.yaml", data, str(rep / "runs"), workers)
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths
    launcher = (cluster_launcher(head[1], head[2], head[0].pid) if mode == "cluster"
                else local_launcher(ray_tmp))
    start = time.monotonic()
    try:
        lineage = run_lineage(launcher, config, rep / "runs" / "run", KILL_SETS[index % 2], rep, timeout=900,
                              rng=random.Random(index))
        problems = audit(rep / "runs" / "run", lineage, EPOCHS, KEEP, METRIC)
    except AssertionError as exc:  # the harness could not apply a kill (e.g. the driver died first)
        lineage, problems = None, [f"harness: {exc}"]
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return {"mode": mode, "repetition": index, "workers": workers, "passed": not problems,
            "problems": problems, "seconds": round(time.monotonic() - start, 1),
            "kills": lineage.kills if lineage else [], "checkpoints": lineage.timeline if lineage else [],
            "driver_start_failures": lineage.start_failures if lineage else None}


def machine() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    load = os.getloadavg()
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "device": "cpu", "commit": commit.stdout.strip(), "load_at_start": [round(x, 1) for x in load]}


def write_results(results: list[dict], info: dict, name: str) -> Path:
    """JSON with every repetition, and a markdown table of passes per mode."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"machine": info, "repetitions": results}, indent=2))
    lines = [f"# Recovery stress ({info['commit']}, {info['host']}, {info['cpus']} CPUs, {info['device']}, "
             f"load {info['load_at_start']})", "",
             f"Each repetition: {EPOCHS} epochs, checkpoints_to_keep={KEEP}, kills (even / odd repetitions): "
             + " / ".join(", ".join(f"{k.target} {k.moment}" for k in ks) for ks in KILL_SETS) + ".", "",
             "| mode | passed | repetitions | workers | median s | driver start failures |",
             "|---|---|---|---|---|---|"]
    for mode in sorted({r["mode"] for r in results}):
        rows = [r for r in results if r["mode"] == mode]
        seconds = sorted(r["seconds"] for r in rows)[len(rows) // 2]
        workers = "/".join(str(w) for w in sorted({r["workers"] for r in rows}))
        restarts = sum(r["driver_start_failures"] or 0 for r in rows)
        lines.append(f"| {mode} | {sum(r['passed'] for r in rows)} | {len(rows)} | {workers} | {seconds} | "
                     f"{restarts} |")
    failed = [r for r in results if not r["passed"]]
    lines += ["", "Failures:" if failed else "No failures."]
    lines += [f"- {r['mode']} #{r['repetition']}: {r['problems']}" for r in failed]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    return RESULTS / f"{name}.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--modes", default="cluster,local", help="comma-separated: cluster, local")
    parser.add_argument("--workers", default="1,2", help="worker counts, each for two repetitions in turn")
    parser.add_argument("--name", default="stress_recovery", help="results file stem under bench/results")
    parser.add_argument("--keep-files", action="store_true", help="keep the run folders and logs")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="puma-stress-"))
    info, results = machine(), []
    data = prepare_data(root)
    workers = [int(w) for w in args.workers.split(",")]
    try:
        for mode in args.modes.split(","):
            temp = Path(tempfile.mkdtemp(prefix="rayh", dir="/tmp"))
            head = start_head(temp) if mode == "cluster" else None
            try:
                for i in range(args.repeats):
                    result = repetition(mode, i, workers[i // 2 % len(workers)], data, root, head)
                    results.append(result)
                    print(f"{mode} #{i} ({result['workers']} worker(s)): "
                          f"{'pass' if result['passed'] else 'FAIL ' + str(result['problems'])} "
                          f"in {result['seconds']:.0f} s", flush=True)
                    write_results(results, info, args.name)
            finally:
                if head is not None:
                    stop_head(head[0])
    finally:
        if not args.keep_files:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"run folders and logs: {root}")
    report = write_results(results, info, args.name)
    passed = sum(r["passed"] for r in results)
    print(f"{passed}/{len(results)} repetitions passed; results: {report} and {report.with_suffix('.json')}")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
