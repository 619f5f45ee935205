"""A real Prometheus Pushgateway for the job-metrics tests (import as ``from pushgateway import ...``).

``Pushgateway(folder)`` runs Debian's ``prometheus-pushgateway`` (installed by scripts/setup.sh) on a
free loopback port; ``samples()`` reads its /metrics exposition, which is what Prometheus scrapes,
and ``value(name, **labels)`` gives one sample's number. ``used_by_monitoring(prefix)``: the pushed
metrics the dashboard and the alert rules use (each job's test checks its push holds them).
"""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus import _free_port, stop_process
from prometheus_client.parser import text_string_to_metric_families


class Pushgateway:
    def __init__(self, folder: Path) -> None:
        binary = shutil.which("prometheus-pushgateway")
        if binary is None:
            pytest.fail("Debian's prometheus-pushgateway is not installed: run scripts/setup.sh "
                        "(apt-get install prometheus-pushgateway)")
        folder.mkdir(parents=True, exist_ok=True)
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.log = folder / "pushgateway.log"
        with open(self.log, "wb") as out:
            # Debian's build persists to /var/lib/prometheus by default: every test gets its own file
            self.process = subprocess.Popen([binary, f"--web.listen-address={self.url.removeprefix('http://')}",
                                             f"--persistence.file={folder / 'pushgateway.data'}"],
                                            stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.text()
                return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    pytest.fail(f"prometheus-pushgateway did not start: {self.log.read_text()[-2000:]}")
                time.sleep(0.2)

    def text(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            return response.read().decode()

    def samples(self, prefix: str = "puma_") -> list[tuple[str, dict, float]]:
        """Every pushed sample whose name starts with ``prefix``: (name, labels, value)."""
        return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(self.text())
                for s in family.samples if s.name.startswith(prefix)]

    def value(self, name: str, **labels: str) -> float | None:
        """The one sample of ``name`` whose labels include ``labels``; None when there is none."""
        found = [v for n, got, v in self.samples(name) if n == name and labels.items() <= got.items()]
        assert len(found) <= 1, f"{name}{labels} matches {len(found)} samples"
        return found[0] if found else None

    def stop(self) -> None:
        stop_process(self.process)


def used_by_monitoring(prefix: str) -> set[str]:
    """The names starting with ``prefix`` that infra/monitoring's dashboard and rules use (at least one)."""
    from monitoring import metric_names_used

    used = {n for names in metric_names_used().values() for n in names if n.startswith(prefix)}
    assert used, f"the dashboard and the rules use no {prefix}* metric"
    return used
