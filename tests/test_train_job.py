"""jobs/train.py end to end on real images with a tiny model: resume after a kill, recovery from a
lost worker, checkpoints that reproduce their embeddings, and `ray job submit` to a real cluster."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
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


def tiny_config(path: Path, data_uri: str, storage_path: str, epochs: int, run_name: str = "run") -> Path:
    """A complete YAML config for a tiny PUMA run on ``data_uri``."""
    cfg = {
        "model": {"backbone": dict(TINY_BACKBONE),
                  "adapter": {"rank": 8}, "prompt_pool": {"pool_size": 4, "length": 2},
                  "head": {"embed_dim": 16}},
        "data": {"uri": data_uri, "preset": "", "num_decode_cpus": 0.25, "decode_batch_size": 8},
        "train": {"epochs": epochs, "batch_size": 8, "cpus_per_worker": 0.5, "storage_path": storage_path,
                  "run_name": run_name, "max_failures": 2},
        "eval": {"batch_size": 32},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def _driver(config: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, "jobs/train.py", "--config", str(config)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _checkpoints(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("checkpoint_*/meta.json"))


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _last_meta(run_dir: Path) -> dict:
    metas = [json.loads(p.read_text()) for p in _checkpoints(run_dir)]
    return max(metas, key=lambda m: m["epoch"])


def _kill_train_worker(ray) -> int:
    """SIGKILL the process of the (single) live RayTrainWorker actor, as a lost node would."""
    from ray._private.state import actors  # GCS actor table: no dashboard needed

    alive = [a for a in actors().values()
             if a["ActorClassName"].endswith("RayTrainWorker") and a["State"] == "ALIVE"]
    assert alive, "no live Ray Train worker to kill"
    os.kill(alive[0]["Pid"], signal.SIGKILL)
    return alive[0]["Pid"]


def test_killed_run_resumes_and_lost_worker_recovers(ray_cluster, tiny_data, tmp_path):
    epochs = 10
    config = tiny_config(tmp_path / "tiny.yaml", tiny_data, str(tmp_path / "runs"), epochs)
    run_dir = tmp_path / "runs" / "run"
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)

    first = _driver(config, env)  # killed mid-way, as a pre-empted driver would be
    _wait(lambda: len(_checkpoints(run_dir)) >= 1 or first.poll() is not None, 240, "a first checkpoint")
    first.kill()
    first.wait()
    killed_at = _last_meta(run_dir)["epoch"]
    assert killed_at < epochs, "the run finished before it could be killed; raise the epoch count"

    second = _driver(config, env)  # the same command again resumes
    _wait(lambda: _last_meta(run_dir)["epoch"] >= killed_at + 1 or second.poll() is not None, 240,
          "a checkpoint after the resume")
    _kill_train_worker(ray_cluster)  # a lost worker restarts from the last checkpoint
    output, _ = second.communicate(timeout=300)
    assert second.returncode == 0, output[-3000:]

    final = _last_meta(run_dir)
    history = final["run_state"]["history"]
    assert final["epoch"] == epochs
    assert [h["epoch"] for h in history] == list(range(1, epochs + 1)), "epochs must continue, not restart"
    steps = [h["step"] for h in history]
    assert steps == sorted(steps) and steps[0] > 0 and len(set(steps)) == epochs
    # at least the driver re-run resumed; the worker loss adds one more when it lands before the last report
    assert final["run_state"]["resumes"] >= 1
    assert final["run_state"]["before"], "zero-shot metrics are kept across resumes"
    assert "harmonic/r@1" in final["metrics"] and "before/harmonic/r@1" in final["metrics"]
    assert "best checkpoint" in output


def test_checkpoint_reloads_and_reproduces_embeddings(ray_cluster, tiny_data, tmp_path):
    from puma.config import load_config
    from puma.train.driver import run_training

    config = tiny_config(tmp_path / "tiny.yaml", tiny_data, str(tmp_path / "runs"), epochs=2)
    outcome = run_training(load_config(config))
    assert outcome.metrics["epoch"] == 2

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path_factory):
    """A real `ray start --head --block` cluster on loopback, the Jobs API on a free port.

    Stopped by signalling its own process group: `ray stop` would stop every Ray on the machine.
    """
    ray_bin = str(Path(PYTHON).parent / "ray")
    temp = tmp_path_factory.mktemp("rayhead", numbered=True)
    gcs, dash = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))  # Ray 2.60 token auth, as in prod
    env["PATH"] = f"{Path(PYTHON).parent}{os.pathsep}{env.get('PATH', '')}"  # `python` = this venv's
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", f"--port={gcs}",
                             "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
                             f"--dashboard-port={dash}", "--num-cpus=4", f"--temp-dir={temp}",
                             # every agent port free-picked: another Ray on this machine may hold defaults
                             f"--dashboard-agent-listen-port={_free_port()}",
                             f"--dashboard-agent-grpc-port={_free_port()}",
                             f"--metrics-export-port={_free_port()}",
                             f"--runtime-env-agent-port={_free_port()}",
                             "--disable-usage-stats"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"http://127.0.0.1:{dash}"
    try:
        _wait(lambda: _answers(f"{address}/api/version") or head.poll() is not None, 120, "the Ray dashboard")
        assert head.poll() is None, "ray start --head exited early"
        yield address, ray_bin, env
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)


def _answers(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:  # 401 without a token: the dashboard is up
        return True
    except OSError:
        return False


def test_ray_job_submit_runs_training(ray_head, tiny_data, tmp_path):
    address, ray_bin, env = ray_head
    config = tiny_config(tmp_path / "tiny.yaml", tiny_data, str(tmp_path / "runs"), epochs=1, run_name="job")
    for _ in range(10):  # the job agent comes up a little after the dashboard
        result = subprocess.run(
            [ray_bin, "job", "submit", f"--address={address}", "--working-dir", ".", "--",
             "python", "jobs/train.py", "--config", str(config)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if "No available agent" not in result.stdout + result.stderr:
            break
        time.sleep(5)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "succeeded" in result.stdout
    assert "harmonic" in result.stdout and "best checkpoint" in result.stdout
    assert _last_meta(tmp_path / "runs" / "job")["epoch"] == 1
