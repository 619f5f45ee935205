"""A new model goes live under load, and back: 8 clients query the service (image queries: embedded by the
model, searched in the index) while model B's version is built and promoted, then rolled back.

Every response must succeed and be answered by one version: the query photo is in the catalogue, so
the model that embeds it and the index that holds its stored embedding agree only when they are of
the same version (top hit = the photo itself, score 1.0; two different models give a lower score).
Each client's versions move A -> B after the promotion and B -> A after the rollback, never back.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tiny import make_checkpoint

from puma.config import load_config
from puma.index.versions import read_alias, rollback, version_name
from puma.inference.job import checkpoint_id, embed_catalogues

REPO = Path(__file__).resolve().parent.parent
FLOWERS = REPO.parent / "shared" / "data" / "flowers12-subset"
CLIENTS = 8
WATCH_S = 0.5
START_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def rollout(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    model_a = make_checkpoint(str(root / "a" / "best"), seed=0)
    model_b = make_checkpoint(str(root / "b" / "best"), seed=11)
    shop = root / "shop"
    shop.mkdir()
    for photo in sorted(FLOWERS.glob("*/*.jpg"))[::80][:12]:  # one photo of each species
        shutil.copy(photo, shop / photo.name)
    index = str(root / "index")
    common = [f"index.uri={index}", "embed.num_cpus=1", "embed.batch_size=8"]
    embed_catalogues(load_config(None, [*common, f"embed.checkpoint={model_a}"]), [str(shop)])
    port = _free_port()
    ray_tmp = tempfile.mkdtemp(prefix="rayr", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"PUMA_RAY_TMP": ray_tmp, "PYTHONUNBUFFERED": "1"})
    env.pop("PUMA_SERVE_TOKEN", None)
    log_path = root / "serve.log"
    argv = [sys.executable, str(REPO / "jobs" / "serve.py"), *common, f"embed.checkpoint={model_a}",
            f"serve.port={port}", f"serve.watch_interval_s={WATCH_S}", "serve.version_grace_s=2",
            "serve.model_num_cpus=0.5", "serve.index_num_cpus=0.25", "serve.ingress_num_cpus=0.25",
            "serve.model_max_replicas=1", "serve.index_max_replicas=1", "serve.max_batch_size=8",
            "serve.batch_wait_timeout_s=0.01"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_until_serving(proc, log_path)
        yield {"url": f"http://127.0.0.1:{port}/search?k=3", "index": index, "shop": shop, "common": common,
               "a": model_a, "b": model_b, "log": log_path}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_serving(proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "Ctrl-C stops it" in text:
            return
        if proc.poll() is not None:
            pytest.fail(f"jobs/serve.py exited with {proc.returncode}:\n{text[-4000:]}")
        time.sleep(1)
    pytest.fail(f"jobs/serve.py did not serve within {START_TIMEOUT_S} s")


class Clients:
    """CLIENTS threads, each querying its own photos in a loop; every answer recorded with its time."""

    def __init__(self, url: str, photos: list[Path]) -> None:
        self.url, self.photos = url, photos
        self.stop = threading.Event()
        self.answers: list[list[tuple]] = [[] for _ in range(CLIENTS)]  # (t_sent, t_got, status, body)
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENTS)]

    def __enter__(self) -> Clients:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=150)

    def _run(self, client: int) -> None:
        import json

        n = 0
        while not self.stop.is_set():
            photo = self.photos[(client + n) % len(self.photos)]
            n += 1
            request = urllib.request.Request(self.url, data=photo.read_bytes(), method="POST",
                                             headers={"Content-Type": "image/jpeg"})
            sent = time.monotonic()
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    status, body = response.status, json.loads(response.read())
            except urllib.error.HTTPError as error:
                status, body = error.code, {"error": error.read().decode(errors="replace")}
            except OSError as error:  # a connection refused or reset counts as a failed request
                status, body = 0, {"error": str(error)}
            self.answers[client].append((sent, time.monotonic(), status, body, photo.name))

    def latest_versions(self) -> set[str]:
        return {a[-1][3].get("version", "") for a in self.answers if a}

    def wait_for(self, version: str, timeout: float) -> float:
        """Seconds until every client's latest answer comes from ``version``."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.latest_versions() == {version}:
                return time.monotonic() - start
            time.sleep(0.05)
        pytest.fail(f"clients still answered by {self.latest_versions()} after {timeout} s")


@pytest.mark.budget(240)  # the service's start-up (40-60 s), model B's version built under load, a rollback
def test_a_new_model_goes_live_under_load_without_a_failed_or_mixed_response_and_rolls_back(rollout):
    a, b = version_name(checkpoint_id(rollout["a"])), version_name(checkpoint_id(rollout["b"]))
    photos = sorted(rollout["shop"].glob("*.jpg"))
    with Clients(rollout["url"], photos) as clients:
        clients.wait_for(a, 60)
        time.sleep(2)
        cfg = load_config(None, [*rollout["common"], f"embed.checkpoint={rollout['b']}"])
        building = time.monotonic()
        reports = embed_catalogues(cfg, [])  # a new model: its version of every live catalogue, promoted
        promoted = time.monotonic()
        assert reports[-1].promoted == b and read_alias(rollout["index"]).live == b
        switch_b = clients.wait_for(b, 60)
        time.sleep(2)
        rollback(rollout["index"])
        rolled = time.monotonic()
        switch_a = clients.wait_for(a, 60)
        time.sleep(1)
    answers = [x for client in clients.answers for x in client]
    failed = [x for x in answers if x[2] != 200]
    assert not failed, f"{len(failed)} of {len(answers)} requests failed, e.g. {failed[:3]}"
    for _sent, _got, _status, body, name in answers:  # one version answered each request, whole
        assert body["version"] == version_name(body["model_id"]) and body["version"] in (a, b)
        top = body["hits"][0]
        assert top["item_id"] == f"shop/{name}" and top["score"] > 0.999, (body["version"], top)
    for client in clients.answers:  # A, then B once promoted, then A once rolled back: never back
        versions = [x[3]["version"] for x in sorted(client)]
        changes = [v for i, v in enumerate(versions) if i == 0 or v != versions[i - 1]]
        assert changes == [a, b, a], changes
        assert all(x[3]["version"] == a for x in client if x[1] < building)  # no B before it was built
        late_a = [x for x in client if x[3]["version"] == a and promoted + switch_b < x[0] < rolled]
        assert not late_a  # once every client saw B, no request sent before the rollback got A
    print(f"rollout: {len(answers)} requests, switch to B {switch_b:.2f} s after promote, back to A "
          f"{switch_a:.2f} s after rollback (watch interval {WATCH_S} s)")
