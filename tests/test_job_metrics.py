"""The jobs' figures pushed to a real Pushgateway (puma/job_metrics.py; Debian's prometheus-pushgateway).

The pushes of real runs are checked where those runs happen: the embedding job in
test_catalogue_job.py, `ray job submit` training in test_train_job.py, a sweep in test_tune.py.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from pushgateway import Pushgateway

from puma.config import ConfigError, MetricsConfig, load_config
from puma.inference.job import EmbedReport
from puma.job_metrics import push_embed, push_sweep, push_train
from puma.sweep.progress import trial_counts


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    gw = Pushgateway(tmp_path_factory.mktemp("pushgateway"))
    yield gw
    gw.stop()


def report(**counts) -> EmbedReport:
    return EmbedReport(catalogue="s3://shop/catalogues/shoes.csv", index_uri="s3://shop/index", **counts)


def test_a_failed_run_keeps_the_last_success_and_its_counts(gateway):
    cfg = MetricsConfig(pushgateway=gateway.url)
    ok = report(added=5, changed=2, removed=1, restamped=3, skipped_indexed=10, images=7, seconds=3.5,
                total=40, reject_reasons={"corrupt": 2, "missing_file": 1})
    assert push_embed(cfg, "shoes", ok)
    at = {"catalogue": "shoes", "job": "puma_embed"}
    counts = {o: gateway.value("puma_embed_items", outcome=o, **at)
              for o in ("added", "changed", "removed", "restamped", "unchanged")}
    assert counts == {"added": 5, "changed": 2, "removed": 1, "restamped": 3, "unchanged": 7}
    assert gateway.value("puma_embed_rejected_items", reason="corrupt", **at) == 2
    assert gateway.value("puma_embed_images_per_second", **at) == pytest.approx(2.0)
    assert gateway.value("puma_embed_index_items", **at) == 40
    assert gateway.value("puma_embed_last_run_failed", **at) == 0
    success = gateway.value("puma_embed_last_success_timestamp_seconds", **at)
    assert success == gateway.value("puma_embed_last_run_timestamp_seconds", **at)

    assert push_embed(cfg, "shoes", report(error="table shoes.csv has no item_id column"))
    assert gateway.value("puma_embed_last_run_failed", **at) == 1
    assert gateway.value("puma_embed_last_run_timestamp_seconds", **at) > success
    assert gateway.value("puma_embed_last_success_timestamp_seconds", **at) == success
    assert gateway.value("puma_embed_items", outcome="added", **at) == 5

    assert push_embed(cfg, "shoes", report(added=1, total=41))  # a reason gone from the rejects: gone here
    assert gateway.value("puma_embed_rejected_items", reason="corrupt", **at) is None
    assert gateway.value("puma_embed_rejected_items", reason="none", **at) == 0


def test_training_pushes_the_epoch_its_loss_speed_and_validation_metrics(gateway):
    metrics = {"epoch": 3, "step": 30, "train/loss": 0.25, "train/samples_per_s": 120.0,
               "train/step_seconds": 0.5, "lr/adapter": 1e-3, "harmonic/r@1": 0.75, "cub/r@1": 0.7,
               "best/harmonic/r@1": 0.75, "run/attempt": 1, "cub/map@r": float("nan")}
    assert push_train(MetricsConfig(pushgateway=gateway.url), "demo", metrics)
    at = {"job": "puma_train", "run": "demo"}
    assert [gateway.value(n, **at) for n in ("puma_train_epoch", "puma_train_loss",
                                              "puma_train_images_per_second", "puma_train_step_seconds")] \
        == [3, 0.25, 120.0, 0.5]
    validation = {s[1]["metric"]: s[2] for s in gateway.samples("puma_train_validation")
                  if s[1]["run"] == "demo"}
    assert validation == {"harmonic/r@1": 0.75, "cub/r@1": 0.7}  # no lr, best/, run/ or NaN


def test_sweep_trials_are_counted_by_state(gateway):
    def trial(status, epoch=None):
        return SimpleNamespace(status=status, last_result={"epoch": epoch} if epoch else {})

    trials = [trial("TERMINATED", 3), trial("TERMINATED", 1), trial("ERROR", 1), trial("RUNNING", 2),
              trial("PENDING"), trial("RUNNING", 3)]
    counts = trial_counts(trials, epochs=3, ending=trials[-1], status="TERMINATED")
    assert counts == {"started": 5, "finished": 2, "pruned": 1, "failed": 1}
    assert push_sweep(MetricsConfig(pushgateway=gateway.url), "lr", counts)
    assert {s[1]["state"]: s[2] for s in gateway.samples("puma_sweep_trials")} == counts


def test_an_unreachable_pushgateway_is_a_warning_not_a_failure(caplog):
    with caplog.at_level(logging.WARNING, logger="puma.job_metrics"):
        unreachable = MetricsConfig(pushgateway="http://127.0.0.1:9", push_timeout_s=2)
        assert not push_embed(unreachable, "shoes", report())
    assert "could not push puma_embed metrics to http://127.0.0.1:9" in caplog.text
    assert push_embed(MetricsConfig(), "shoes", report())  # none set: nothing to do


def test_a_pushgateway_that_is_not_a_url_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"metrics.pushgateway='gw:9091' must be an http\(s\):// URL"):
        load_config(None, ["metrics.pushgateway=gw:9091"])
