"""A real Prometheus server for the metrics tests (import as ``from prometheus import ...``).

``Prometheus(targets, folder)`` runs Debian's ``prometheus`` (installed by scripts/setup.sh) on a free
loopback port, scraping each ``host:port`` target every second into a TSDB in ``folder``; ``value``
asks its HTTP API for an instant query's single number, ``wait_for`` polls one until a condition holds.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, targets: list[str], folder: Path) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("Debian's prometheus is not installed: run scripts/setup.sh "
                        "(apt-get install prometheus)")
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "prometheus.yml"
        config.write_text(json.dumps({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                                      "scrape_configs": [{"job_name": "ray",
                                                          "static_configs": [{"targets": targets}]}]}))
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.log = folder / "prometheus.log"
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}"],
                stdout=out, stderr=subprocess.STDOUT)
        self.wait_for("up", lambda v: v == 1, timeout=60)

    def query(self, promql: str) -> list[dict]:
        """The instant query's result vector."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def names(self) -> set[str]:
        """Every metric name the server has scraped."""
        with urllib.request.urlopen(f"{self.url}/api/v1/label/__name__/values", timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return set(body["data"])

    def value(self, promql: str) -> float | None:
        """The query's one number (None while it has no series; a sum over none is no series)."""
        result = self.query(promql)
        assert len(result) <= 1, f"{promql} has {len(result)} series: {result}"
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, promql: str, holds: Callable[[float | None], bool],
                 timeout: float = 90) -> float | None:
        """Poll ``promql`` until ``holds(value)``; fails with the last value and the server's log."""
        deadline, value = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log.read_text()[-2000:]
                pytest.fail(f"prometheus exited with {self.process.returncode}: {tail}")
            try:
                value = self.value(promql)
            except OSError:  # not listening yet
                value = None
            if holds(value):
                return value
            time.sleep(0.5)
        pytest.fail(f"{promql} was {value} after {timeout:.0f} s")

    def stop(self) -> None:
        stop_process(self.process)


def stop_process(process: subprocess.Popen) -> None:
    """Terminate a server (killed if it has not exited within 30 s)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
