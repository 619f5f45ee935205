"""The search service's Prometheus metrics, through Ray's metrics API (``ray.serve.metrics``).

Each replica records into Ray's metrics agent on its node, which exports them on the node's metrics
port beside Ray's and Ray Serve's own (``ray_`` is prefixed, counters get ``_total``); Serve adds the
``deployment``, ``replica`` and ``application`` tags. A KubeRay cluster's PodMonitor scrapes that port;
on one machine ``jobs/serve.py`` prints it (``serve.metrics_port``).

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
- ``ray_puma_version_switches_total`` (counter): versions the replica went live with after its first.

Ray Serve's own metrics cover what happens before a request reaches the ingress, e.g. the 503s of a
full queue (``ray_serve_num_http_error_requests_total``, ``ray_serve_deployment_queued_queries``).
"""

from __future__ import annotations

# seconds; fine steps up to 20 ms (the service answers in about 2.5 ms), then coarser to 10 s
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
                     0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class ServiceMetrics:
    """The ingress replica's metrics (created in the replica: Ray's metrics live in its process)."""

    def __init__(self, enabled: bool = True) -> None:
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

    def request(self, route: str, kind: str, status: int, seconds: float) -> None:
        if not self.enabled:
            return
        tags = {"route": route, "kind": kind}
        self.requests.inc(1, tags={**tags, "status": str(status)})
        self.latency.observe(seconds, tags=tags)
        self.seconds.inc(seconds, tags=tags)

    def refusal(self, cause: str) -> None:
        if not self.enabled:
            return
        self.refused.inc(1, tags={"cause": cause or "unavailable"})

    def live(self, version: str, model_id: str) -> None:
        """This replica answers with ``version`` from now on (the previous one's gauge goes to 0)."""
        if not self.enabled or self._live == (version, model_id):
            return
        if self._live is not None:
            self.version.set(0, tags={"version": self._live[0], "model_id": self._live[1]})
            self.switches.inc(1)
        self.version.set(1, tags={"version": version, "model_id": model_id})
        self._live = (version, model_id)
