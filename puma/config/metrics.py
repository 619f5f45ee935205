"""``metrics``: the jobs' figures for Prometheus (puma/job_metrics.py)."""

from __future__ import annotations

from dataclasses import dataclass

from puma.config.checks import _check


@dataclass
class MetricsConfig:
    """Jobs' figures for Prometheus (puma/job_metrics.py); the service's are ``serve.metrics``."""

    pushgateway: str = ""  # a Prometheus Pushgateway (http://host:9091) the jobs push their figures to: the
    # embedding job each catalogue's counts, training each epoch's, a sweep its trials'; '' = none pushed
    push_timeout_s: float = 5.0  # a push that takes longer is given up (a warning; the job goes on)

    def __post_init__(self) -> None:
        _check(not self.pushgateway or self.pushgateway.startswith(("http://", "https://")),
               f"metrics.pushgateway={self.pushgateway!r} must be an http(s):// URL, e.g. "
               "http://prometheus-pushgateway.monitoring:9091, or '' for none")
        _check(self.push_timeout_s > 0, f"metrics.push_timeout_s={self.push_timeout_s!r} must be > 0")
