"""The search service's Prometheus metrics, through Ray's metrics API (``ray.serve.metrics``).

Each replica records into Ray's metrics agent on its node (the ingress from a thread of its own,
every 100 ms: ServiceMetrics), which exports them on the node's metrics port beside Ray's and Ray
Serve's own (``ray_`` is prefixed, counters get ``_total``); Serve adds the ``deployment``,
``replica`` and ``application`` tags. A KubeRay cluster's PodMonitor scrapes that port; on one
machine ``jobs/serve.py`` prints it (``serve.metrics_port``).

Exported as (type; tags):

- ``ray_puma_requests_total`` (counter; route, kind, status): requests answered, by route, query kind
  (image, item_id, vector; empty off /search) and HTTP status;
- ``ray_puma_request_seconds`` (histogram; route, kind): a request's time in the ingress, arrival to
  answer, in buckets that resolve 0.5-1 ms up to 20 ms;
- ``ray_puma_request_time_seconds_total`` (counter; route, kind): the same times summed exactly (Ray
  exports a histogram's ``_sum`` from its buckets' midpoints, not from the values observed);
- ``ray_puma_refused_total`` (counter; cause): the ingress's 503s: backpressure (a deployment's queue
  full), partition_timeout, replica_unavailable;
- ``ray_puma_version_live`` (gauge; version, model_id): 1 for the version the replica answers with;
- ``ray_puma_version_switches_total`` (counter): versions the replica went live with after its first;
- ``ray_puma_stage_seconds`` (histogram; stage): a query's model forward (``model``: the embed call,
  its batch wait included), its index search (``index``: with partitions, the fan-out and merge) and,
  with partitions, the merge of their top-k (``merge``);
- ``ray_puma_filter_columns_total`` (counter; column): filtered queries, once per column the filter names;
- ``ray_puma_model_batch_size`` (histogram): the model deployment's batches (QueryModel replicas);
- ``ray_puma_index_items``, ``ray_puma_index_shards``, ``ray_puma_index_removed_rows`` (gauges; version,
  partition): what each index replica serves of each version it holds loaded (0 once dropped);
- ``ray_puma_index_refreshed_timestamp_seconds`` (gauge; partition): the replica's last successful
  look at storage (a watch tick that read the manifest, changed or not);
- ``ray_puma_manifest_written_timestamp_seconds`` (gauge; version, partition): when the manifest the
  replica serves was written, i.e. the served index's last change (a run that changes nothing writes
  a record, but the replica keeps serving what it loaded).

Ray Serve's own metrics cover what happens before a request reaches the ingress, e.g. the 503s of a
full queue (``ray_serve_num_http_error_requests_total``, ``ray_serve_deployment_queued_queries``).
"""

from __future__ import annotations

import calendar
import logging
import threading
import time
from collections import Counter, deque

# seconds; fine steps up to 20 ms (the service answers in about 2.5 ms), then coarser to 10 s
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
                     0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
FLUSH_INTERVAL_S = 0.1  # how often a replica hands its queries' notes to Ray's metrics (Serve: 100 ms)
REFUSAL_CAUSES = ("backpressure", "partition_timeout", "replica_unavailable")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # serve.max_batch_size <= 4096

log = logging.getLogger(__name__)


class ServiceMetrics:
    """The ingress replica's metrics (created in the replica: Ray's metrics live in its process).

    A query only notes what happened (appends to a queue, 3-4 us for an image query); a thread of the
    replica hands the notes to Ray every ``flush_interval_s``, each counter's sum once per tag set, as
    Ray Serve exports its own request metrics (``RAY_SERVE_METRICS_EXPORT_INTERVAL_MS``). Recorded on
    the query's own thread, each of Ray's records lets go of the GIL, and under load every one cost the
    query a wait for the replica's other threads: 6-13% of the queries/s at 8 clients (bench_serve).
    """

    def __init__(self, enabled: bool = True, flush_interval_s: float = FLUSH_INTERVAL_S) -> None:
        self.enabled = enabled
        self._live: tuple[str, str] | None = None
        if not enabled:  # serve.metrics=false: every record is a no-op
            return
        from ray.serve import metrics

        self.requests = metrics.Counter("puma_requests", "Requests answered by the search service",
                                        tag_keys=("route", "kind", "status"))
        self.latency = metrics.Histogram("puma_request_seconds", "Request time in the ingress (seconds)",
                                         boundaries=list(LATENCY_BUCKETS_S), tag_keys=("route", "kind"))
        self.seconds = metrics.Counter("puma_request_time_seconds",
                                       "Request time in the ingress, summed exactly (seconds)",
                                       tag_keys=("route", "kind"))
        self.refused = metrics.Counter("puma_refused", "503s given by the ingress, by cause",
                                       tag_keys=("cause",))
        self.version = metrics.Gauge("puma_version_live", "1 for the version this replica answers with",
                                     tag_keys=("version", "model_id"))
        self.switches = metrics.Counter("puma_version_switches",
                                        "Versions this replica went live with after its first")
        # exported at 0 from the start (Prometheus's advice: a rate needs the series before the first event)
        for cause in REFUSAL_CAUSES:
            self.refused._record(0, tags={"cause": cause})  # Counter.inc refuses 0
        self.switches._record(0)
        self.stages = metrics.Histogram("puma_stage_seconds",
                                        "A query's model, index and merge time (seconds)",
                                        boundaries=list(LATENCY_BUCKETS_S), tag_keys=("stage",))
        self.filters = metrics.Counter("puma_filter_columns", "Filtered queries, once per column named",
                                       tag_keys=("column",))
        self._notes: deque[tuple] = deque()  # appends and poplefts are atomic: no lock on the query's path
        self._version_lock = threading.Lock()  # live() and the flush's refresh of the version gauge
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_every, args=(flush_interval_s,), daemon=True,
                                         name="puma-metrics-flush")
        self._flusher.start()

    def request(self, route: str, kind: str, status: int, seconds: float) -> None:
        if self.enabled:
            self._notes.append(("request", (route, kind), str(status), seconds))

    def stage(self, stage: str, seconds: float) -> None:
        if self.enabled:
            self._notes.append(("stage", stage, seconds))

    def filtered(self, columns) -> None:
        if self.enabled:
            self._notes.append(("filter", tuple(columns)))

    def refusal(self, cause: str) -> None:
        if self.enabled:
            self._notes.append(("refusal", cause or "unavailable"))

    def live(self, version: str, model_id: str) -> None:
        """This replica answers with ``version`` from now on (the previous one's gauge goes to 0)."""
        if not self.enabled:
            return
        with self._version_lock:
            if self._live == (version, model_id):
                return
            if self._live is not None:
                self.version.set(0, tags={"version": self._live[0], "model_id": self._live[1]})
                self.switches.inc(1)
            self.version.set(1, tags={"version": version, "model_id": model_id})
            self._live = (version, model_id)

    def flush(self) -> int:
        """Hand every note taken so far to Ray's metrics; the number of notes. Counters get one record
        per tag set, histograms one per time observed."""
        if not self.enabled:
            return 0
        notes = []
        while self._notes:
            notes.append(self._notes.popleft())
        counts: Counter = Counter()
        seconds: Counter = Counter()
        for note in notes:
            if note[0] == "request":
                (route, kind), status, took = note[1:]
                counts[("request", route, kind, status)] += 1
                seconds[(route, kind)] += took
                self.latency.observe(took, tags={"route": route, "kind": kind})
            elif note[0] == "stage":
                self.stages.observe(note[2], tags={"stage": note[1]})
            elif note[0] == "filter":
                counts.update(("filter", column) for column in note[1])
            else:
                counts[("refusal", note[1])] += 1
        self._record_counts(counts, seconds)
        with self._version_lock:  # Ray's agent drops a gauge not exported for two intervals: kept fresh
            if self._live is not None:
                self.version.set(1, tags={"version": self._live[0], "model_id": self._live[1]})
        return len(notes)

    def close(self) -> None:
        """Stop the flushing thread after a last flush."""
        if self.enabled and not self._stop.is_set():
            self._stop.set()
            self._flusher.join(timeout=5)
            self.flush()

    def _record_counts(self, counts: Counter, seconds: Counter) -> None:
        for key, n in counts.items():
            if key[0] == "request":
                self.requests.inc(n, tags={"route": key[1], "kind": key[2], "status": key[3]})
            elif key[0] == "filter":
                self.filters.inc(n, tags={"column": key[1]})
            else:
                self.refused.inc(n, tags={"cause": key[1]})
        for (route, kind), total in seconds.items():
            if total > 0:
                self.seconds.inc(total, tags={"route": route, "kind": kind})

    def _flush_every(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - metrics never take the service down
                log.exception("could not record the service's metrics")


class ModelMetrics:
    """A QueryModel replica's batch sizes."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        if enabled:
            from ray.serve import metrics

            self.sizes = metrics.Histogram("puma_model_batch_size",
                                           "Images per batch of the model deployment",
                                           boundaries=list(BATCH_BUCKETS))

    def batch(self, size: int) -> None:
        if self.enabled:
            self.sizes.observe(size)


class IndexMetrics:
    """What an index replica serves (the ingress's LocalIndex, or one IndexPartition replica)."""

    def __init__(self, partition: int, enabled: bool = True) -> None:
        self.enabled, self.partition = enabled, str(partition)
        self._versions: set[str] = set()
        if not enabled:
            return
        from ray.serve import metrics

        keys = ("version", "partition")
        self.items = metrics.Gauge("puma_index_items", "Items served, by version", tag_keys=keys)
        self.shards = metrics.Gauge("puma_index_shards", "Shards served, by version", tag_keys=keys)
        self.removed = metrics.Gauge("puma_index_removed_rows", "Removed rows not yet compacted, by version",
                                     tag_keys=keys)
        self.written = metrics.Gauge("puma_manifest_written_timestamp_seconds",
                                     "When the served manifest was written (unix seconds)", tag_keys=keys)
        self.refreshed = metrics.Gauge("puma_index_refreshed_timestamp_seconds",
                                       "The replica's last successful look at storage (unix seconds)",
                                       tag_keys=("partition",))

    def served(self, versions: dict[str, tuple[int, int, int, str]]) -> None:
        """``versions``: each loaded version's (items, shards, removed rows, manifest's ``updated``);
        a version recorded before and not loaded now is set to 0. Marks a successful refresh."""
        if not self.enabled:
            return
        for version in self._versions - set(versions):
            self._set(version, 0, 0, 0, 0.0)
        for version, (items, shards, removed, updated) in versions.items():
            self._set(version, items, shards, removed, unix_time(updated))
        self._versions = set(versions)
        self.refreshed.set(time.time(), tags={"partition": self.partition})

    def _set(self, version: str, items: int, shards: int, removed: int, written: float) -> None:
        tags = {"version": version, "partition": self.partition}
        self.items.set(items, tags=tags)
        self.shards.set(shards, tags=tags)
        self.removed.set(removed, tags=tags)
        self.written.set(written, tags=tags)


def unix_time(stamp: str) -> float:
    """A manifest's ``updated`` (``2026-12-06T18:35:11Z``) as unix seconds; 0 when unset or unreadable."""
    try:
        return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")))
    except (TypeError, ValueError):
        return 0.0
