"""puma.storage on local paths and on a real S3 server (SeaweedFS): the one retry policy, permanent
errors that fail on the first attempt, and transient failures injected by a proxy on 127.0.0.1
(tests/s3proxy.py) that are retried until the work completes."""

from __future__ import annotations

import random
import re
import socket
import time

import pytest
from s3proxy import DOWN, ERROR_500, ERROR_503, RESET, S3Proxy, at_put, every, first

from puma import storage
from puma.config import ConfigError, RetryConfig, StorageConfig
from puma.errors import UserError


def _round_trip(root: str) -> None:
    a, b = storage.join(root, "x", "a.bin"), storage.join(root, "x", "y", "b.txt")
    storage.write_bytes(a, b"\x00\x01payload")
    storage.write_text(b, "héllo")
    assert storage.read_bytes(a) == b"\x00\x01payload"
    assert storage.read_text(b) == "héllo"
    assert storage.exists(a) and not storage.exists(storage.join(root, "x", "nope"))
    assert storage.list_files(root) == sorted([a, b])
    assert storage.list_files(root, suffix=".txt") == [b]
    assert storage.list_files(storage.join(root, "x"), recursive=False) == [a]
    assert storage.list_dirs(storage.join(root, "x")) == [storage.join(root, "x", "y")]
    assert b"".join(storage.iter_chunks(a, chunk=3)) == b"\x00\x01payload"
    with pytest.raises(FileNotFoundError, match="no object at"):
        storage.read_bytes(storage.join(root, "missing.bin"))
    storage.delete(storage.join(root, "x", "y"))
    assert storage.list_files(root) == [a]
    assert storage.list_files(storage.join(root, "does-not-exist")) == []


def test_local_round_trip(tmp_path):
    _round_trip(str(tmp_path / "root"))


def test_s3_round_trip(s3_storage):
    _round_trip(s3_storage)
    assert storage.current_config().endpoint_url.startswith("http://127.0.0.1:")


# ----------------------------------------------------------------------------- the policy


def test_backoff_is_capped_exponential_with_equal_jitter():
    policy = storage.RetryPolicy(max_attempts=8, initial_backoff_s=0.25, max_backoff_s=2.0)
    rng = random.Random(0)
    for retry, cap in enumerate([0.25, 0.5, 1.0, 2.0, 2.0, 2.0]):
        waits = [policy.backoff(retry, rng) for _ in range(200)]
        assert cap / 2 <= min(waits) and max(waits) <= cap  # at least half the cap: outages are waited out
        assert max(waits) - min(waits) > cap / 4  # and jittered, so clients do not retry in lockstep


@pytest.mark.parametrize(("message", "kind"), [
    ("When getting information for key 'x' in bucket 'b': AWS Error NETWORK_CONNECTION during HeadObject "
     "operation: curlCode: 7, Could not connect to server", storage.UNREACHABLE),
    ("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 56, Failure when receiving data "
     "from the peer", storage.UNREACHABLE),
    ("AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 28, Timeout was reached",
     storage.UNREACHABLE),
    ("AWS Error UNKNOWN (HTTP status 503) during HeadObject operation: No response body.", storage.BUSY),
    ("AWS Error SLOW_DOWN during PutObject operation: Please reduce your request rate.", storage.BUSY),
    ("AWS Error INTERNAL_FAILURE during GetObject operation: Failed to flush response stream", storage.BUSY),
    ("AWS Error ACCESS_DENIED during HeadObject operation: No response body.", storage.DENIED),
    ("AWS Error SIGNATURE_DOES_NOT_MATCH during ListObjectsV2 operation: The request signature ...",
     storage.DENIED),
    ("AWS Error UNKNOWN (HTTP status 403) during HeadObject operation", storage.DENIED),
    ("AWS Error NO_SUCH_BUCKET during ListObjectsV2 operation: The specified bucket does not exist",
     storage.NO_BUCKET),
    ("AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 35, SSL connect error; Details: "
     "TLS connect error: error:0A00010B:SSL routines::wrong version number", storage.BAD_ENDPOINT),
    ("AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 6, Couldn't resolve host name",
     storage.BAD_ENDPOINT),
    ("AWS Error UNKNOWN (HTTP status 400) during HeadObject operation", storage.OTHER),
])
def test_errors_are_sorted_into_transient_and_permanent(message, kind):
    assert storage.classify(OSError(message)).kind == kind
    assert (kind in storage.TRANSIENT) == (kind in (storage.UNREACHABLE, storage.BUSY))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_endpoint_is_reported_fast_in_one_line_naming_uri_and_endpoint(aws_test_env):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    storage.configure(StorageConfig(endpoint_url=endpoint))  # the default policy
    try:
        start = time.monotonic()
        with pytest.raises(storage.StorageError) as err:
            storage.read_bytes("s3://puma-test/some/key.bin")
        seconds = time.monotonic() - start
    finally:
        storage.configure(StorageConfig())
    text = str(err.value)
    assert "\n" not in text and isinstance(err.value, UserError)
    assert "s3://puma-test/some/key.bin" in text and endpoint in text and "cannot reach" in text
    attempts, reported = re.search(r"(\d+) attempts in ([\d.]+) s", text).groups()
    assert int(attempts) == RetryConfig().max_attempts  # retried: refused is transient
    assert 1.5 < seconds < 10.0 and abs(float(reported) - seconds) < 1.0  # ~4-8 s by default


def test_no_retry_starts_after_max_elapsed(aws_test_env):
    retry = RetryConfig(max_attempts=50, initial_backoff_s=0.2, max_elapsed_s=1.0)
    storage.configure(StorageConfig(endpoint_url=f"http://127.0.0.1:{_closed_port()}", retry=retry))
    try:
        start = time.monotonic()
        with pytest.raises(storage.StorageError, match="cannot reach"):
            storage.exists("s3://puma-test/k")
        assert time.monotonic() - start < 1.5  # 50 attempts allowed, the time bound stops them
    finally:
        storage.configure(StorageConfig())


def test_an_endpoint_without_scheme_is_a_config_error(monkeypatch, aws_test_env):
    with pytest.raises(ConfigError, match=r"storage.endpoint_url='127.0.0.1:8333' has no scheme: write "
                                          r"http://127.0.0.1:8333"):
        StorageConfig(endpoint_url="127.0.0.1:8333")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "127.0.0.1:8333")  # the same mistake in the environment
    storage.configure(StorageConfig())
    with pytest.raises(storage.StorageError, match=r"^AWS_ENDPOINT_URL='127.0.0.1:8333' has no scheme"):
        storage.exists("s3://puma-test/k")


# ----------------------------------------------------------------------------- through a proxy


@pytest.fixture
def proxy(s3_server, s3_storage):
    """A failure-injecting proxy in front of the test server; puma.storage talks to it."""
    host, port = s3_server.endpoint.removeprefix("http://").split(":")
    p = S3Proxy((host, int(port))).start()
    storage.configure(StorageConfig(endpoint_url=p.endpoint, region="us-east-1",
                                    retry=RetryConfig(max_attempts=4, initial_backoff_s=0.1)))
    yield p
    p.stop()
    storage.configure(s3_server.storage_config)


def _direct(s3_server):
    """A boto3 client straight to the server (no proxy), to check what really landed."""
    import boto3

    return boto3.session.Session().client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1")


@pytest.mark.parametrize("action", [ERROR_503, ERROR_500, RESET])
def test_injected_transient_failures_are_retried_and_a_multi_object_write_completes(s3_server, s3_storage,
                                                                                    proxy, action):
    proxy.plan = every(3, action)  # every third request fails: most objects need a retry somewhere
    uris = {storage.join(s3_storage, f"obj-{i:02d}.bin"): bytes([i]) * (1000 + i) for i in range(12)}
    for uri, data in uris.items():
        storage.write_bytes(uri, data)
    assert [storage.read_bytes(uri) for uri in uris] == list(uris.values())
    assert storage.list_files(s3_storage) == sorted(uris)
    assert proxy.count(action) >= 10  # failures really happened, and were retried past
    client = _direct(s3_server)
    for uri, data in uris.items():  # what is on the server, read without the proxy
        key = uri.removeprefix(f"s3://{s3_server.bucket}/")
        assert client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read() == data


def test_a_server_restart_in_the_middle_of_a_multi_object_write_is_ridden_out(s3_server, s3_storage, proxy):
    proxy.down_seconds = 2.0
    proxy.plan = at_put(6, DOWN)
    storage.configure(StorageConfig(endpoint_url=proxy.endpoint, region="us-east-1"))  # the default policy
    uris = [storage.join(s3_storage, f"part-{i:02d}.txt") for i in range(10)]
    start = time.monotonic()
    for i, uri in enumerate(uris):
        storage.write_text(uri, f"part {i}")
    seconds = time.monotonic() - start
    assert proxy.count(DOWN) == 1 and seconds >= 2.0  # the 6th PUT met the restart and waited it out
    assert sum(1 for r in proxy.log if r.method == "PUT" and r.action == "pass") == 10  # then went through
    assert [storage.read_text(u) for u in uris] == [f"part {i}" for i in range(10)]


def test_permanent_errors_fail_on_the_first_attempt(s3_storage, proxy, monkeypatch):
    uri = storage.join(s3_storage, "k.txt")
    storage.write_text(uri, "v")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value-xyz")
    storage.configure(storage.current_config())  # a fresh filesystem reads the chain again
    for call in (lambda: storage.read_bytes(uri), lambda: storage.write_text(uri, "w"),
                 lambda: storage.list_files(s3_storage)):
        proxy.log.clear()
        with pytest.raises(storage.StorageError) as err:
            call()
        assert len(proxy.log) == 1  # one request: a refused credential is never retried
        text = str(err.value)
        assert "refused the credentials" in text and proxy.endpoint in text and uri.rsplit("/", 1)[0] in text
        assert "credentials from the environment" in text and "wrong-secret-value-xyz" not in text
    assert storage.redact("key=wrong-secret-value-xyz") == "key=***"


def test_attempts_do_not_multiply_across_layers(s3_storage, proxy):
    uri = storage.join(s3_storage, "busy.txt")
    storage.write_text(uri, "v")
    proxy.plan = first(10_000, ERROR_503)  # the server is always busy
    proxy.log.clear()
    with pytest.raises(storage.StorageError, match=r"kept answering with server errors .*4 attempts"):
        storage.read_bytes(uri)
    assert len(proxy.log) == 4  # storage.retry.max_attempts, not 4 x pyarrow's own retries
    proxy.log.clear()
    fs = storage.ray_filesystem(uri)  # for Ray Data, which retries on its own: one attempt per call
    with pytest.raises(OSError):
        fs.get_file_info(uri.removeprefix("s3://"))
    assert len(proxy.log) == 1
    proxy.log.clear()
    path, fs = storage.ray_storage(uri)  # for Ray Train / Tune, which do not retry: pyarrow's strategy
    with pytest.raises(OSError):
        fs.get_file_info(path)
    assert len(proxy.log) == 4


# ----------------------------------------------------------------------------- preflight


def test_preflight_checks_endpoint_credentials_buckets_and_inputs(s3_server, s3_storage, proxy, monkeypatch):
    storage.write_text(storage.join(s3_storage, "in", "a.txt"), "x")
    proxy.log.clear()
    assert storage.preflight(inputs=[storage.join(s3_storage, "in"), "local/path", ""],
                             outputs=[storage.join(s3_storage, "out"), "hub"]) == 2
    assert len(proxy.log) == 2  # one listing per S3 location
    with pytest.raises(storage.StorageError, match=r"checking s3://puma-test/.*/nothing failed: nothing the"):
        storage.preflight(inputs=[storage.join(s3_storage, "nothing")])
    proxy.log.clear()
    with pytest.raises(storage.StorageError) as err:
        storage.preflight(outputs=["s3://no-such-bucket-23/runs"])
    assert "bucket 'no-such-bucket-23' does not exist" in str(err.value) and "aws s3 mb" in str(err.value)
    assert len(proxy.log) == 1  # a missing bucket is not retried
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    proxy.log.clear()
    with pytest.raises(storage.StorageError, match=r"refused the credentials \(SignatureDoesNotMatch, HTTP"):
        storage.preflight(outputs=[storage.join(s3_storage, "out")])
    assert len(proxy.log) == 1
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    with pytest.raises(storage.StorageError, match="no AWS credentials found"):
        storage.preflight(outputs=[storage.join(s3_storage, "out")])


def test_ensure_bucket_creates_once(s3_storage):
    uri = "s3://puma-extra-bucket/some/key.txt"
    storage.ensure_bucket(uri)
    storage.ensure_bucket(uri)  # idempotent
    storage.write_text(uri, "x")
    assert storage.read_text(uri) == "x"
    names = {b["Name"] for b in storage.boto3_client().list_buckets()["Buckets"]}
    assert {"puma-test", "puma-extra-bucket"} <= names


def test_display_uri_keeps_the_scheme(s3_storage):
    path, fs = storage.ray_storage(storage.join(s3_storage, "runs"))
    assert storage.display_uri(path, fs) == storage.join(s3_storage, "runs")
    assert storage.display_uri("/tmp/runs", None) == "/tmp/runs"


def _read_in_a_ray_task(uri: str, settings) -> bytes:
    """Run in a Ray worker: configure with ``settings`` (None: forget to) and read ``uri``."""
    if settings is not None:
        storage.configure(settings)
    return storage.read_bytes(uri)


def test_a_ray_task_that_uses_s3_without_the_drivers_settings_fails_loudly(ray_cluster, s3_storage):
    """The settings travel with the work: a task handed storage.current_config() reads the test server;
    one that was not handed them refuses (it would otherwise use the default endpoint, not the server)."""
    ray = ray_cluster
    uri = storage.join(s3_storage, "a.bin")
    storage.write_bytes(uri, b"payload")
    task = ray.remote(num_cpus=0.1, max_retries=0, runtime_env={"env_vars": {"PUMA_FRESH_WORKER": "1"}})(
        _read_in_a_ray_task)  # a runtime_env of its own: a fresh worker process, never configured
    with pytest.raises(ray.exceptions.RayTaskError, match="before its storage settings arrived"):
        ray.get(task.remote(uri, None))
    assert ray.get(task.remote(uri, storage.current_config())) == b"payload"


def _read_after_use_storage(uri: str, settings) -> bytes:
    """Run in a Ray worker: what an embedding actor does first, then read ``uri``."""
    from puma.inference.embedder import use_storage

    use_storage(settings)
    return storage.read_bytes(uri)


def test_an_actor_given_settings_equal_to_its_environments_is_still_configured(ray_cluster, s3_storage):
    """With the endpoint in AWS_ENDPOINT_URL (the object-storage walk-through), a fresh worker's own
    settings equal the driver's before it configures anything; it must configure all the same (the embed
    job's actors once skipped it and refused to read the checkpoint)."""
    ray = ray_cluster
    uri = storage.join(s3_storage, "b.bin")
    storage.write_bytes(uri, b"payload")
    env = {"AWS_ENDPOINT_URL": storage.s3_endpoint(), "AWS_REGION": storage.s3_region()}
    driver = storage._S3Settings(endpoint_url=env["AWS_ENDPOINT_URL"], region=env["AWS_REGION"])  # a default
    # config's current_config() with that environment: the worker's own settings before any configure
    task = ray.remote(num_cpus=0.1, max_retries=0, runtime_env={"env_vars": env})(_read_after_use_storage)
    assert ray.get(task.remote(uri, driver)) == b"payload"
