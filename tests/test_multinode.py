"""Two Ray nodes on one machine (tests/raynodes.py) with every artifact on a real S3 server (SeaweedFS):
training across nodes equals training on one node, a node lost mid-epoch is survived without an
epoch lost or trained twice, embedding survives a lost node, and an S3 server stopped in the middle of
a checkpoint or index-shard write never leaves a listed-but-partial artifact.

The head offers the custom resource ``node_a``, the second node ``node_b`` (`ray start --resources`),
so placement can be forced; drivers join with RAY_ADDRESS, as `ray job submit` runs them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from conftest import AWS_TEST_ENV, _free_port, _stop_server, _wait_for_s3, _weed_command
from raynodes import RayHead, cluster_env, kill_node, start_head_with_retries, start_node, stop_node
from tiny import TINY_BACKBONE

from puma import storage
from puma.config import RetryConfig, StorageConfig

REPO = Path(__file__).resolve().parent.parent
FLOWERS = REPO.parent / "shared" / "data" / "flowers12-subset"
PYTHON = sys.executable
BUCKET = "multinode"


# ----------------------------------------------------------------------------- S3 server, restartable


class OwnS3:
    """A SeaweedFS S3 server of this module's own, stopped and started again on the same ports and data."""

    def __init__(self, data_dir: Path):
        taken: set[int] = set()
        names = ("s3", "master", "volume", "filer", "admin")
        self.data_dir, self.ports = data_dir, {n: _free_port(taken) for n in names}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        log = self.data_dir / "weed.log"
        with open(log, "ab") as out:
            self.process = subprocess.Popen(_weed_command(self.data_dir, self.ports), stdout=out,
                                            stderr=subprocess.STDOUT, env={**os.environ, **AWS_TEST_ENV},
                                            cwd=self.data_dir)
        _wait_for_s3(self.endpoint, self.process, log)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            _stop_server(self.process)

    @property
    def storage_config(self) -> StorageConfig:
        return StorageConfig(endpoint_url=self.endpoint, region=AWS_TEST_ENV["AWS_REGION"],
                             retry=RetryConfig(max_attempts=6, max_elapsed_s=20.0))


@dataclass
class TwoNodes:
    head: RayHead
    node_b: subprocess.Popen
    s3: OwnS3
    temp: Path
    restarts: int = 0

    def restart_node_b(self) -> None:
        """A new second node (new node id, same resources), as a replacement machine joining."""
        self.restarts += 1
        self.node_b = start_node(self.head, resources={"node_b": 4})


@pytest.fixture(scope="module")
def cluster(aws_test_env, tmp_path_factory):
    s3 = OwnS3(tmp_path_factory.mktemp("weed"))
    s3.start()
    temp = tmp_path_factory.mktemp("nodes")
    head = node_b = None
    try:
        storage.configure(s3.storage_config)
        storage.ensure_bucket(f"s3://{BUCKET}/x")
        head = start_head_with_retries(cluster_env(), resources={"node_a": 4})
        node_b = start_node(head, resources={"node_b": 4})
        yield (two := TwoNodes(head, node_b, s3, temp))
        node_b = two.node_b
    finally:
        storage.configure(StorageConfig())
        for node in (node_b, head.pid if head else None):
            if node is not None:
                stop_node(node)
        s3.stop()


@pytest.fixture(scope="module")
def s3_data(cluster, tmp_path_factory) -> str:
    """6 Oxford-Flowers species x 24 real photos, prepared to Parquet on S3 (3 train / 3 test classes)."""
    from puma.data.prepare import prepare
    from puma.data.sources import SourceSpec

    root = tmp_path_factory.mktemp("flowers")
    for species in sorted(p for p in FLOWERS.iterdir() if p.is_dir())[:6]:
        (root / species.name).mkdir()
        for photo in sorted(species.glob("*.jpg"))[:24]:
            shutil.copy(photo, root / species.name / photo.name)
    uri = f"s3://{BUCKET}/data"
    storage.configure(cluster.s3.storage_config)
    prepare([SourceSpec("folder", "flowers", str(root))], uri, log=lambda _: None)
    return uri


def train_config(path: Path, cluster: TwoNodes, data: str, run: str, epochs: int, **train) -> Path:
    """A tiny two-worker run with everything on S3 (``train``: more train.* keys)."""
    path.write_text(yaml.safe_dump({
        "model": {"backbone": dict(TINY_BACKBONE), "adapter": {"rank": 8},
                  "prompt_pool": {"pool_size": 4, "length": 2}, "head": {"embed_dim": 16}},
        "data": {"uri": data, "preset": "", "num_decode_cpus": 0.25, "decode_batch_size": 8,
                 "deterministic": True},
        "train": {"epochs": epochs, "batch_size": 8, "num_workers": 2, "cpus_per_worker": 0.5,
                  "storage_path": f"s3://{BUCKET}/runs", "run_name": run, "max_failures": 3, **train},
        "eval": {"batch_size": 32},
        "storage": {"endpoint_url": cluster.s3.endpoint, "region": AWS_TEST_ENV["AWS_REGION"]},
    }))
    return path


def start_driver(cluster: TwoNodes, config: Path, log: Path) -> subprocess.Popen:
    """``python jobs/train.py --config FILE`` joining the cluster (RAY_ADDRESS), output to ``log``;
    every progress event of the workers becomes a line (PUMA_PROGRESS_EVERY_S=0)."""
    env = dict(cluster.head.env, RAY_ADDRESS=cluster.head.gcs, PYTHONUNBUFFERED="1",
               PUMA_PROGRESS_EVERY_S="0")
    with open(log, "w") as out:
        return subprocess.Popen([PYTHON, "jobs/train.py", "--config", str(config)], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def finish(driver: subprocess.Popen, log: Path, timeout: float = 600) -> str:
    try:
        code = driver.wait(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        os.killpg(driver.pid, 9)
        tail = log.read_text()[-3000:]
        raise AssertionError(f"the driver did not finish in {timeout:.0f}s:\n{tail}") from exc
    output = log.read_text(errors="replace")
    assert code == 0, output[-4000:]
    return output


def run_state(run: str) -> dict:
    """The run state of the newest checkpoint of s3://BUCKET/runs/<run>."""
    from puma.checkpoint import read_checkpoint
    from puma.train.recovery import newest_complete

    newest = newest_complete(f"s3://{BUCKET}/runs/{run}")
    assert newest is not None, f"no complete checkpoint in run {run}"
    return read_checkpoint(newest.uri).meta["run_state"]


def attempts(run: str) -> list[dict]:
    folder = f"s3://{BUCKET}/runs/{run}/attempts"
    return [json.loads(storage.read_text(u)) for u in sorted(storage.list_files(folder, suffix=".json"))]


def model_state(run: str) -> dict[str, torch.Tensor]:
    from puma.checkpoint import read_checkpoint
    from puma.train.recovery import newest_complete

    return read_checkpoint(newest_complete(f"s3://{BUCKET}/runs/{run}").uri).model


# ----------------------------------------------------------------------------- training across nodes


def test_training_across_two_nodes_equals_two_workers_on_one_node(cluster, s3_data, tmp_path):
    """STRICT_SPREAD puts one worker on each node (gloo between them); the same seed with both
    workers pinned to the head (node_a) must give the same history and weights: data.deterministic
    hands each rank the same rows, so only the placement differs."""
    spread = train_config(tmp_path / "spread.yaml", cluster, s3_data, "spread", epochs=2,
                          placement_strategy="STRICT_SPREAD")
    packed = train_config(tmp_path / "packed.yaml", cluster, s3_data, "packed", epochs=2,
                          worker_resources={"node_a": 1})
    for config, log in ((spread, tmp_path / "spread.log"), (packed, tmp_path / "packed.log")):
        finish(start_driver(cluster, config, log), log)

    spread_nodes = {w["node_id"] for w in attempts("spread")[0]["workers"]}
    packed_nodes = {w["node_id"] for w in attempts("packed")[0]["workers"]}
    assert len(spread_nodes) == 2 and len(packed_nodes) == 1, (spread_nodes, packed_nodes)
    a, b = run_state("spread")["history"], run_state("packed")["history"]
    assert [h["epoch"] for h in a] == [h["epoch"] for h in b] == [1, 2]
    for ha, hb in zip(a, b, strict=True):
        assert ha["step"] == hb["step"] and ha["train/loss"] == pytest.approx(hb["train/loss"], rel=1e-4)
        assert ha["harmonic/r@1"] == pytest.approx(hb["harmonic/r@1"], abs=1e-6)
    wa, wb = model_state("spread"), model_state("packed")
    assert set(wa) == set(wb)
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-4, atol=1e-5, msg=key)
    assert not list(Path(REPO).glob("artifacts/runs/spread*")), "nothing of the run may land on local disk"


# ----------------------------------------------------------------------------- a node lost mid-epoch


def complete_epochs(run: str) -> list[int]:
    """Epochs of the run's checkpoint folders on S3 whose meta.json exists (written last: complete).

    Cheap on purpose (a listing and one HEAD per folder), so a kill can follow a checkpoint closely.
    """
    epochs = []
    for uri in storage.list_dirs(f"s3://{BUCKET}/runs/{run}"):
        name = uri.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("checkpoint_epoch") and storage.exists(storage.join(uri, "meta.json")):
            epochs.append(int(name[len("checkpoint_epoch"):].split("_")[0]))
    return sorted(epochs)


def wait_for_step(log: Path, epoch: int, epochs: int, driver: subprocess.Popen, timeout: float = 300) -> int:
    """Block until the driver's log shows the workers part-way into ``epoch`` (step k of n, 0 < k < n)."""
    pattern = re.compile(rf"epoch {epoch}/{epochs}: (\d+)/(\d+) steps")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for step, total in pattern.findall(log.read_text(errors="replace")):
            if 0 < int(step) < int(total):
                return int(step)
        assert driver.poll() is None, f"the driver exited early:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)
    raise AssertionError(f"epoch {epoch} was not seen part-way in {timeout:.0f}s:\n{log.read_text()[-3000:]}")


def test_a_node_lost_mid_epoch_is_survived_without_losing_or_repeating_an_epoch(cluster, s3_data, tmp_path):
    """SIGKILL the second node (its raylet and its worker) part-way into epoch 2, then a replacement
    node joins: Ray Train restarts the worker group, which continues after epoch 1 from S3."""
    epochs, log = 4, tmp_path / "lost.log"
    config = train_config(tmp_path / "lost.yaml", cluster, s3_data, "lost", epochs=epochs, batch_size=4,
                          placement_strategy="STRICT_SPREAD", eval_before=False, eval_every=epochs)
    driver = start_driver(cluster, config, log)  # 18 steps an epoch
    step = wait_for_step(log, 3, epochs, driver)  # the workers say they are part-way into epoch 3
    done_at_kill = complete_epochs("lost")
    killed = kill_node(cluster.node_b)
    cluster.restart_node_b()
    finish(driver, log)

    assert done_at_kill == [1, 2] and killed, f"the kill must land in epoch 3 (step {step})"
    state = run_state("lost")
    assert [(h["epoch"], h["attempt"]) for h in state["history"]] == [(1, 1), (2, 1), (3, 2), (4, 2)]
    assert (state["resumes"], state["recomputed_epochs"]) == (1, 0)
    first_attempt, second_attempt = attempts("lost")
    assert second_attempt["after_epoch"] == 2
    assert second_attempt["resumed_from"].startswith("checkpoint_epoch0002_attempt001")
    before = {w["node_id"] for w in first_attempt["workers"]}
    after = {w["node_id"] for w in second_attempt["workers"]}
    assert len(before) == len(after) == 2 and len(before & after) == 1, "one node replaced, one kept"
    assert "resumed from" in log.read_text()
