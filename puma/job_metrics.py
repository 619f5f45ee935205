"""Jobs' figures for Prometheus, pushed to a Pushgateway (``metrics.pushgateway``).

A job may end before Prometheus would scrape it, so each pushes what it did when it knows it: the
embedding job after each catalogue, training after each epoch (rank 0, beside TensorBoard), a sweep
whenever a trial starts or ends. The run records (the index manifest's runs, the checkpoints'
metrics, the sweep's results) stay the source of truth; a push that fails is a warning, never the
job's failure. Pushed as (gauges; the ``job`` label is the job, the grouping label its subject):

- ``job="puma_embed"``, grouping ``catalogue``: ``puma_embed_items{outcome}`` (the last run's added,
  changed, removed, restamped and unchanged items), ``puma_embed_rejected_items{reason}`` (items listed
  as rejects after the run), ``puma_embed_images_per_second``, ``puma_embed_run_seconds``,
  ``puma_embed_index_items`` (the index's items after the run), ``puma_embed_last_run_timestamp_seconds``,
  ``puma_embed_last_run_failed`` (0/1) and ``puma_embed_last_success_timestamp_seconds``; a failed
  run pushes only the last two of its kind (the last success's figures stay);
- ``job="puma_train"``, grouping ``run``: ``puma_train_epoch``, ``puma_train_loss``,
  ``puma_train_images_per_second``, ``puma_train_step_seconds``, ``puma_train_validation{metric}``
  (the epoch's validation metrics, e.g. ``harmonic/r@1``) and ``puma_train_last_report_timestamp_seconds``;
- ``job="puma_sweep"``, grouping ``sweep``: ``puma_sweep_trials{state}`` (started, finished, pruned by
  ASHA, failed).

Each push replaces the group's metrics of the same names (the Pushgateway's POST), so a reason or a
metric that no longer applies disappears with the next push.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping

from puma.config import MetricsConfig

log = logging.getLogger(__name__)

EMBED_OUTCOMES = ("added", "changed", "removed", "restamped", "unchanged")
SWEEP_STATES = ("started", "finished", "pruned", "failed")
NOT_VALIDATION = ("train", "run", "best", "before", "lr")  # the other prefixes of an epoch's metrics


class Figures:
    """Gauges for one push: ``set(name, value, help, **labels)``, then :func:`push`."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry()
        self._gauges: dict = {}

    def set(self, name: str, value: float, help_text: str, **labels: str) -> None:
        from prometheus_client import Gauge

        if name not in self._gauges:
            self._gauges[name] = Gauge(name, help_text, tuple(labels), registry=self.registry)
        gauge = self._gauges[name]
        (gauge.labels(**labels) if labels else gauge).set(float(value))


def push(cfg: MetricsConfig, job: str, grouping: Mapping[str, str], figures: Figures) -> bool:
    """Push ``figures`` to ``cfg.pushgateway`` under ``job`` and ``grouping``; False (with a warning) when
    it cannot be reached or refuses; nothing (True) when no Pushgateway is set."""
    if not cfg.pushgateway:
        return True
    from prometheus_client import pushadd_to_gateway

    try:
        pushadd_to_gateway(cfg.pushgateway, job=job, registry=figures.registry, grouping_key=dict(grouping),
                           timeout=cfg.push_timeout_s)
    except OSError as exc:  # URLError, HTTPError (refused push), timeouts
        log.warning("could not push %s metrics to %s (%s); the run's record is unaffected",
                    job, cfg.pushgateway, exc)
        return False
    return True


def push_embed(cfg: MetricsConfig, catalogue: str, report) -> bool:
    """One catalogue's run (``report``: a puma.inference.job.EmbedReport; ``catalogue``: its name)."""
    figures, now = Figures(), time.time()
    figures.set("puma_embed_last_run_timestamp_seconds", now, "When the catalogue's last run ended")
    figures.set("puma_embed_last_run_failed", 1 if report.error else 0, "1 when the last run failed")
    if not report.error:
        _embed_figures(figures, report, now)
    return push(cfg, "puma_embed", {"catalogue": catalogue}, figures)


def _embed_figures(figures: Figures, report, now: float) -> None:
    counts = {"added": report.added, "changed": report.changed, "removed": report.removed,
              "restamped": report.restamped, "unchanged": report.skipped_indexed - report.restamped}
    for outcome in EMBED_OUTCOMES:
        figures.set("puma_embed_items", counts[outcome], "The last run's items by outcome", outcome=outcome)
    for reason, n in sorted(report.reject_reasons.items()):
        figures.set("puma_embed_rejected_items", n, "Items listed as rejects after the run", reason=reason)
    if not report.reject_reasons:  # a series at 0, so that rules see the catalogue has none
        figures.set("puma_embed_rejected_items", 0, "Items listed as rejects after the run", reason="none")
    figures.set("puma_embed_images_per_second", report.images / report.seconds if report.seconds > 0 else 0.0,
                "Images decoded and embedded per second of the last run")
    figures.set("puma_embed_run_seconds", report.seconds, "The last run's duration")
    figures.set("puma_embed_index_items", report.total, "Items in the index after the last run")
    figures.set("puma_embed_last_success_timestamp_seconds", now, "When the catalogue's last run succeeded")


def push_train(cfg: MetricsConfig, run_name: str, metrics: Mapping[str, object]) -> bool:
    """One epoch's report (the metrics dict rank 0 reports to Ray Train)."""
    figures = Figures()
    named = {"puma_train_epoch": ("epoch", "Epochs done"),
             "puma_train_loss": ("train/loss", "The epoch's mean training loss"),
             "puma_train_images_per_second": ("train/samples_per_s", "Training images per second"),
             "puma_train_step_seconds": ("train/step_seconds", "Seconds per training step")}
    for name, (key, help_text) in named.items():
        if _finite(metrics.get(key)):
            figures.set(name, metrics[key], help_text)
    for key, value in sorted(metrics.items()):
        if "/" in key and key.split("/", 1)[0] not in NOT_VALIDATION and _finite(value):
            figures.set("puma_train_validation", value, "The epoch's validation metrics", metric=key)
    figures.set("puma_train_last_report_timestamp_seconds", time.time(), "When the last epoch was reported")
    return push(cfg, "puma_train", {"run": run_name}, figures)


def push_sweep(cfg: MetricsConfig, sweep: str, counts: Mapping[str, int]) -> bool:
    """The sweep's trials by state."""
    figures = Figures()
    for state in SWEEP_STATES:
        figures.set("puma_sweep_trials", counts.get(state, 0), "The sweep's trials by state", state=state)
    return push(cfg, "puma_sweep", {"sweep": sweep}, figures)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
