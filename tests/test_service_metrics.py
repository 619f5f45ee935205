"""The ingress's metrics (puma/serve/metrics.py): a query only notes what happened, and the replica's
flushing thread hands every note to Ray's metrics, none lost and none counted twice.

Ray's real metric objects are used (outside a Ray worker their records go nowhere); each is wrapped
to count what reaches it before passing the call on. The scrape through a real Prometheus is
tests/test_serve_app.py's."""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter

import pytest

from puma.serve.metrics import ServiceMetrics


class Seen:
    """What reached each of a ServiceMetrics' Ray metrics: (metric, tags) -> summed values, observations
    and the last value set."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.sums: Counter = Counter()
        self.observed: Counter = Counter()
        self.last: dict = {}
        self.calls = 0
        self._lock = threading.Lock()
        for name in ("requests", "seconds", "refused", "filters", "switches"):
            self._wrap(metrics, name, "inc", self._add)
        for name in ("latency", "stages"):
            self._wrap(metrics, name, "observe", self._observe)
        self._wrap(metrics, "version", "set", self._set)

    def _wrap(self, metrics: ServiceMetrics, name: str, method: str, note) -> None:
        metric = getattr(metrics, name)
        real = getattr(metric, method)

        def call(value, tags=None):
            with self._lock:
                self.calls += 1
                note((name, tuple(sorted((tags or {}).items()))), value)
            return real(value, tags=tags)

        setattr(metric, method, call)

    def _add(self, key, value) -> None:
        self.sums[key] += value

    def _observe(self, key, value) -> None:
        self.observed[key] += 1
        self.sums[key] += value

    def _set(self, key, value) -> None:
        self.last[key] = value


def tags(**kw) -> tuple:
    return tuple(sorted(kw.items()))


def test_a_query_records_nothing_in_ray_until_the_flush():
    metrics = ServiceMetrics(flush_interval_s=3600)
    seen = Seen(metrics)
    try:
        for _ in range(50):
            metrics.request("/search", "vector", 200, 0.002)
            metrics.stage("index", 0.001)
            metrics.filtered(["price"])
        metrics.refusal("backpressure")
        assert seen.calls == 0  # nothing of Ray's on the query's path
        assert metrics.flush() == 151
        # counters once per tag set, with the sums; histograms once per time observed
        assert seen.sums[("requests", tags(route="/search", kind="vector", status="200"))] == 50
        assert seen.sums[("seconds", tags(route="/search", kind="vector"))] == pytest.approx(0.1)
        assert seen.observed[("latency", tags(route="/search", kind="vector"))] == 50
        assert seen.observed[("stages", tags(stage="index"))] == 50
        assert seen.sums[("filters", tags(column="price"))] == 50
        assert seen.sums[("refused", tags(cause="backpressure"))] == 1
        assert seen.calls == 50 + 50 + 4  # the two histograms' times, four counters
        assert metrics.flush() == 0
    finally:
        metrics.close()


def test_notes_from_many_threads_reach_ray_exactly_once_while_the_flusher_runs():
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch after almost every bytecode: races show
    try:
        noted_from_threads(ServiceMetrics(flush_interval_s=0.0))
    finally:
        sys.setswitchinterval(switch)


def noted_from_threads(metrics: ServiceMetrics) -> None:
    seen = Seen(metrics)
    threads, per_thread = 4, 5000

    def queries(i: int) -> None:
        for n in range(per_thread):
            metrics.request("/search", ("image", "vector")[i % 2], 200 if n % 10 else 503, 0.001)
            if n % 10 == 0:
                metrics.refusal("partition_timeout")

    workers = [threading.Thread(target=queries, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    time.sleep(0.05)  # the flusher has run during and after the queries
    metrics.close()  # a last flush
    answered = sum(v for (name, _), v in seen.sums.items() if name == "requests")
    observed = sum(v for (name, _), v in seen.observed.items() if name == "latency")
    assert answered == observed == threads * per_thread
    for kind in ("image", "vector"):
        assert seen.sums[("requests", tags(route="/search", kind=kind, status="503"))] == 2 * per_thread // 10
    assert seen.sums[("refused", tags(cause="partition_timeout"))] == threads * per_thread // 10
    vector_seconds = seen.sums[("seconds", tags(route="/search", kind="vector"))]
    assert vector_seconds == pytest.approx(2 * per_thread * 0.001)
    assert seen.calls > 8  # it flushed more than once on the way
    assert not metrics._flusher.is_alive()


def test_the_version_gauge_ends_1_for_the_live_version_alone_while_flushes_refresh_it():
    """live() and the flush's refresh of the gauge take turns: a refresh that read the old version
    must not set it back to 1 after the switch set it to 0."""
    metrics = ServiceMetrics(flush_interval_s=3600)
    seen = Seen(metrics)
    stop = threading.Event()

    def flushing() -> None:
        while not stop.is_set():
            metrics.flush()

    flusher = threading.Thread(target=flushing)
    flusher.start()
    try:
        for n in range(3000):
            metrics.live(f"v{n}", "m")
    finally:
        stop.set()
        flusher.join()
        metrics.close()
    ones = [key for key, value in seen.last.items() if value == 1]
    assert ones == [("version", tags(version="v2999", model_id="m"))]
    assert seen.sums[("switches", ())] == 2999
