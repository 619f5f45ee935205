"""jobs/train.py end to end on real images with a tiny model: a killed driver and a lost worker
continue from the newest complete checkpoint (tests/kill_harness.py), checkpoints that reproduce
their embeddings, and `ray job submit` to a real cluster."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from kill_harness import Kill, attempt_records, audit, cluster_launcher, complete_checkpoints, run_lineage
from pushgateway import Pushgateway, used_by_monitoring
from raynodes import cluster_env, start_head_with_retries, stop_node
from tiny import TINY_BACKBONE

from puma.checkpoint import CheckpointError, load_model, read_checkpoint
from puma.data.prepare import prepare
from puma.data.sources import SourceSpec

REPO = Path(__file__).resolve().parent.parent
FLOWERS = REPO.parent / "shared" / "data" / "flowers12-subset"
PYTHON = sys.executable


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> str:
    """6 Oxford-Flowers species x 8 real photos, prepared to Parquet (3 train / 3 test classes)."""
    root = tmp_path_factory.mktemp("flowers")
    for species in sorted(p for p in FLOWERS.iterdir() if p.is_dir())[:6]:
        (root / species.name).mkdir()
        for photo in sorted(species.glob("*.jpg"))[:8]:
            shutil.copy(photo, root / species.name / photo.name)
    out = str(tmp_path_factory.mktemp("prepared"))
    prepare([SourceSpec("folder", "flowers", str(root))], out, log=lambda _: None)
    return out


def tiny_config(path: Path, data_uri: str, storage_path: str, epochs: int, run_name: str = "run",
                train: dict | None = None) -> Path:
    """A complete YAML config for a tiny PUMA run on ``data_uri`` (``train``: more train.* keys)."""
    cfg = {
        "model": {"backbone": dict(TINY_BACKBONE),
                  "adapter": {"rank": 8}, "prompt_pool": {"pool_size": 4, "length": 2},
                  "head": {"embed_dim": 16}},
        "data": {"uri": data_uri, "preset": "", "decode_batch_size": 8},
        "train": {"epochs": epochs, "batch_size": 8, "cpus_per_worker": 0.5, "storage_path": storage_path,
                  "run_name": run_name, "max_failures": 2, **(train or {})},
        "eval": {"batch_size": 32},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def _checkpoints(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("checkpoint_*/meta.json"))


def _last_meta(run_dir: Path) -> dict:
    metas = [json.loads(p.read_text()) for p in _checkpoints(run_dir)]
    return max(metas, key=lambda m: m["epoch"])


@pytest.mark.budget(310)  # three drivers on a `ray start` cluster (59 s alone, 64-155 s beside another)
def test_killed_driver_and_lost_worker_continue_from_the_newest_complete_checkpoint(ray_head, tiny_data,
                                                                                   tmp_path):
    """On a `ray start --head` cluster that outlives the driver, at the worst moment: the driver is
    SIGKILLed right after its first checkpoint is complete on storage (maybe before Ray registers it,
    before best/ is published: rank 0 holds there until the kill, kill_harness.py), the same command is
    run again, and one Ray Train worker of the re-run is SIGKILLed right after its first checkpoint.
    Every epoch must be written exactly once, each attempt must continue after the newest complete
    epoch, and best/ must hold the run's best model (a kill before its publication is repaired).

    Deterministic: whenever the kills land, a complete checkpoint exists, so both restarts must
    continue from it (Ray's own checkpoint lags storage by up to two there: puma/train/recovery.py).
    Every checkpoint folder is kept (checkpoints_to_keep >= epochs), so the audit reads the complete
    record from storage instead of depending on a watcher's timing."""
    epochs = 3  # killed after epochs 1 and 2: the third attempt trains the last
    config = tiny_config(tmp_path / "tiny.yaml", tiny_data, str(tmp_path / "runs"), epochs,
                         train={"checkpoints_to_keep": epochs, "max_failures": 3})
    run_dir = tmp_path / "runs" / "run"
    launcher = cluster_launcher(ray_head.gcs, ray_head.env, ray_head.pid)
    lineage = run_lineage(launcher, config, run_dir, [Kill("driver"), Kill("worker")], tmp_path,
                          timeout=600)  # per checkpoint: a loaded 2-core machine needs minutes to start Ray

    print(f"lineage: {lineage.seconds:.0f} s, kills {lineage.kills}, checkpoints {lineage.timeline}")
    assert audit(run_dir, lineage, epochs, keep=epochs, metric="harmonic/r@1") == []
    assert [k["after_epoch"] for k in lineage.kills] == [1, 2]  # the second run's first checkpoint
    records = attempt_records(run_dir)
    assert [(r["attempt"], r["after_epoch"]) for r in records] == [(1, 0), (2, 1), (3, 2)]
    # what only a real resume leaves behind: each later epoch was written by the attempt after the kill
    written = {f["epoch"]: f["attempt"] for f in complete_checkpoints(run_dir)}
    assert written == {1: 1, 2: 2, **{e: 3 for e in range(3, epochs + 1)}}
    final = _last_meta(run_dir)
    assert final["metrics"]["run/resumes"] == 2 and final["metrics"]["run/recomputed_epochs"] == 0
    assert "harmonic/r@1" in final["metrics"] and "before/harmonic/r@1" in final["metrics"]
    assert "best checkpoint" in lineage.output()


def reloads_and_reproduces_embeddings(outcome, tmp_path: Path) -> None:
    """The run's best and last checkpoints load (verifying their stored probe embeddings), hold exactly
    the trainable weights, and refuse a different frozen backbone."""
    for uri in (outcome.best_checkpoint, outcome.last_checkpoint):
        model, cfg = load_model(uri)  # verifies the stored probe embeddings itself
        state = read_checkpoint(uri)
        images = torch.Generator().manual_seed(1234)
        probe = torch.randn(2, 3, 32, 32, generator=images)
        with torch.no_grad():
            torch.testing.assert_close(model(probe), torch.tensor(state.meta["probe"]), rtol=0, atol=1e-5)
        assert cfg.model.head.embed_dim == 16
        assert set(state.model) == {k for k, p in model.named_parameters() if p.requires_grad}

    other = tmp_path / "other_backbone.safetensors"  # a different frozen backbone must be refused
    from safetensors.torch import save_file

    backbone = {k: v + 0.05 if v.is_floating_point() else v
                for k, v in load_model(outcome.best_checkpoint)[0].backbone.state_dict().items()
                if "adapter" not in k}
    save_file(backbone, str(other))
    with pytest.raises(CheckpointError, match="does not reproduce its embeddings"):
        load_model(outcome.best_checkpoint, backbone_weights=str(other))


@pytest.mark.budget(220)  # a run, a resumed run, checkpoint reloads, all on S3 (39-110 s; 164 s on CI)
def test_a_run_on_s3_reloads_its_checkpoints_and_continues_from_the_newest_complete_one_when_ray_has_none(
        ray_cluster, s3_server, s3_storage, tiny_data, tmp_path):
    """Runs and checkpoints on a real S3 server. After two epochs the best and last checkpoints reload
    from S3 and reproduce their embeddings; then Ray's snapshot is removed (as if Ray had registered
    nothing before the driver died): the same run with three epochs must continue after epoch 2 from
    the folders on S3, and best/ must read through its pointer there."""
    from puma import storage
    from puma.checkpoint import best_record
    from puma.config import load_config
    from puma.train.driver import run_training

    config = tiny_config(tmp_path / "tiny.yaml", tiny_data, s3_storage, epochs=2)
    endpoint = [f"storage.endpoint_url={s3_server.endpoint}", "storage.retries=2"]
    first = run_training(load_config(config, endpoint))
    run = storage.join(s3_storage, "run")
    assert first.metrics["epoch"] == 2 and storage.is_s3(first.last_checkpoint)
    reloads_and_reproduces_embeddings(first, tmp_path)
    storage.delete(storage.join(run, "checkpoint_manager_snapshot.json"))

    second = run_training(load_config(config, [*endpoint, "train.epochs=3"]))

    assert second.metrics["epoch"] == 3 and second.metrics["run/resumes"] == 1
    assert second.metrics["run/recomputed_epochs"] == 0
    history = read_checkpoint(second.last_checkpoint).meta["run_state"]["history"]
    assert [(h["epoch"], h["attempt"]) for h in history] == [(1, 1), (2, 1), (3, 2)]
    record = json.loads(storage.read_text(storage.join(run, "attempts", "attempt_0002.json")))
    assert (record["after_epoch"], record["ray_checkpoint"]) == (2, None)
    best = best_record(second.best_checkpoint, "harmonic/r@1")
    values = [h["harmonic/r@1"] for h in history]
    assert best["epoch"] == history[values.index(max(values))]["epoch"]
    load_model(second.best_checkpoint)


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A real `ray start --head --block` cluster on loopback, Jobs API on a free port (tests/raynodes.py)."""
    head = start_head_with_retries(cluster_env())
    try:
        yield head
    finally:
        stop_node(head.pid)


@pytest.mark.budget(180)  # `ray start --head`, then `ray job submit` of a tiny run (31-116 s)
def test_ray_job_submit_runs_training(ray_head, tiny_data, tmp_path):
    address, ray_bin, env = ray_head.address, ray_head.ray_bin, ray_head.env
    config = tiny_config(tmp_path / "tiny.yaml", tiny_data, str(tmp_path / "runs"), epochs=1, run_name="job")
    gateway = Pushgateway(tmp_path / "pushgateway")  # rank 0 pushes each epoch's figures there
    try:
        for _ in range(10):  # the job agent comes up a little after the dashboard
            result = subprocess.run(
                [ray_bin, "job", "submit", f"--address={address}", "--working-dir", ".", "--",
                 "python", "jobs/train.py", "--config", str(config), f"metrics.pushgateway={gateway.url}"],
                cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
            if "No available agent" not in result.stdout + result.stderr:
                break
            time.sleep(5)
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        assert "succeeded" in result.stdout
        assert "harmonic" in result.stdout and "best checkpoint" in result.stdout
        metrics = _last_meta(tmp_path / "runs" / "job")["metrics"]
        assert metrics["epoch"] == 1
        at = {"job": "puma_train", "run": "job"}
        assert gateway.value("puma_train_epoch", **at) == 1
        assert gateway.value("puma_train_loss", **at) == pytest.approx(metrics["train/loss"])
        assert gateway.value("puma_train_validation", metric="harmonic/r@1", **at) \
            == pytest.approx(metrics["harmonic/r@1"])
        assert used_by_monitoring("puma_train_") <= {n for n, _, _ in gateway.samples()}
    finally:
        gateway.stop()
