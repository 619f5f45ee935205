"""The search service under overload and faults: `python jobs/serve.py` (direct ingress, the index in
two partition deployments) on its own local Ray.

Overload: beyond serve.max_ongoing_requests + serve.max_queued_requests, a request gets 503 with
Retry-After at once instead of waiting. Replica kill: SIGKILL to a partition replica's process under
load; requests held may fail (503), none hangs, and the service answers in full again once Serve has
replaced the replica. Requests are slowed with the serve.search delay point (puma.faults) so that a
few clients fill the queue.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from puma.config import IndexConfig
from puma.index import build_index

REPO = Path(__file__).resolve().parent.parent
DIM, ITEMS, DELAY_S = 16, 240, 0.4
START_TIMEOUT_S = 240


def vectors(n: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def free_port_pair() -> int:
    """A port p with p + 1 free too (direct ingress: the ingress on p, Serve's proxy on p + 1)."""
    import socket

    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", port + 1))
                    return port
            except OSError:
                continue
    raise RuntimeError("no two free ports in a row")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    x = vectors(ITEMS, 0)
    index = str(root / "index")
    build_index(index, pa.table({"item_id": [f"i/{i:03d}" for i in range(ITEMS)],
                                 "embedding": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), DIM)}),
                IndexConfig(index_type="flat", shard_size=60), model_id="m")
    port, log_path = free_port_pair(), root / "serve.log"
    ray_tmp = tempfile.mkdtemp(prefix="rayl", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"PUMA_RAY_TMP": ray_tmp, "PYTHONUNBUFFERED": "1",
                "PUMA_FAULT_DELAY": f"serve.search:{DELAY_S}"})
    env.pop("PUMA_SERVE_TOKEN", None)
    argv = [sys.executable, str(REPO / "jobs" / "serve.py"), f"index.uri={index}", f"serve.port={port}",
            "serve.image_queries=false", "serve.index_partitions=2", "serve.index_num_cpus=0.25",
            "serve.index_max_replicas=1", "serve.ingress_num_cpus=0.25", "serve.max_ongoing_requests=2",
            "serve.max_queued_requests=2", "serve.retry_after_s=1", "serve.watch_interval_s=1"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "Ctrl-C stops it" not in log_path.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"jobs/serve.py did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(1)
        yield {"url": f"http://127.0.0.1:{port}/", "x": x, "log": log_path}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def query(url: str, q: np.ndarray, k: int = 5, timeout: float = 10.0) -> tuple[int, dict, dict, float]:
    """(status, JSON body or {}, headers, seconds) of one vector query; a timeout raises (a hang)."""
    body = json.dumps({"vector": q.tolist(), "k": k}).encode()
    request = urllib.request.Request(url + "search", data=body, headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return (response.status, json.loads(response.read()), _lower(response.headers),
                    time.perf_counter() - start)
    except urllib.error.HTTPError as exc:
        data = exc.read()
        try:
            parsed = json.loads(data)
        except ValueError:
            parsed = {"text": data.decode(errors="replace")}
        return exc.code, parsed, _lower(exc.headers), time.perf_counter() - start


def _lower(headers) -> dict:
    return {name.lower(): value for name, value in headers.items()}


def expected(x: np.ndarray, q: np.ndarray, k: int = 5) -> list[str]:
    return [f"i/{i:03d}" for i in np.argsort(-(x @ q), kind="stable")[:k]]


def test_overload_gets_503_with_retry_after_at_once_and_the_rest_are_answered(service):
    x, results, lock = service["x"], [], threading.Lock()

    def client(i: int) -> None:
        answer = query(service["url"], x[i])
        with lock:
            results.append((i, *answer))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 24  # none hangs
    ok = [r for r in results if r[1] == 200]
    refused = [r for r in results if r[1] == 503]
    assert len(ok) + len(refused) == 24, [r[1:3] for r in results if r[1] not in (200, 503)]
    assert 2 <= len(ok) <= 12 and len(refused) >= 12
    assert all(r[3].get("retry-after") == "1" for r in refused), [(r[2], r[3]) for r in refused][:3]
    assert max(r[4] for r in refused) < DELAY_S  # refused at once, not after waiting in a queue
    for i, _status, body, _headers, _s in ok:
        assert [h["item_id"] for h in body["hits"]] == expected(x, x[i])


def replica_pids(name: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"ray::ServeReplica:puma-search:{name}"], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def test_a_partition_replica_killed_under_load_fails_some_requests_hangs_none_and_recovers(service):
    x, url, stop, results, lock = service["x"], service["url"], threading.Event(), [], threading.Lock()
    before = replica_pids("index-0")
    assert len(before) == 1

    def client(c: int) -> None:
        i = c
        while not stop.is_set():
            status, body, _headers, seconds = query(url, x[i % ITEMS])
            with lock:
                results.append((time.monotonic(), i % ITEMS, status, body, seconds))
            i += 2

    threads = [threading.Thread(target=client, args=(c,)) for c in range(2)]
    for t in threads:
        t.start()
    time.sleep(2)
    killed_at = time.monotonic()
    os.kill(before[0], signal.SIGKILL)
    recovered = None
    deadline = killed_at + 90
    while time.monotonic() < deadline and recovered is None:
        time.sleep(1)
        with lock:
            late = [r for r in results if r[0] > killed_at + 1]
        # recovered: a new replica process answers, and the last 10 answers are all full and exact
        replaced = replica_pids("index-0") not in ([], before)
        exact = len(late) >= 10 and all(
            r[2] == 200 and [h["item_id"] for h in r[3]["hits"]] == expected(x, x[r[1]]) for r in late[-10:])
        if replaced and exact:
            recovered = time.monotonic() - killed_at
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert recovered is not None, sorted({(r[2], json.dumps(r[3])[:200]) for r in results})[:5]
    assert all(r[2] in (200, 503) for r in results), {r[2] for r in results}  # a failure: 503, never 500
    assert max(r[4] for r in results) < 10  # none hangs
    assert sum(r[2] == 200 for r in results if r[0] < killed_at) >= 3
