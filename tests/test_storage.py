"""puma.storage on local paths and on a real S3 server (SeaweedFS), with injected transient failures."""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest

from puma import storage
from puma.config import StorageConfig


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


def test_s3_credentials_are_enforced_and_never_logged(s3_storage, monkeypatch):
    storage.write_text(storage.join(s3_storage, "k.txt"), "v")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value-xyz")
    storage.configure(StorageConfig(endpoint_url=storage.s3_endpoint(), retries=0))
    with pytest.raises(storage.StorageError) as err:
        storage.read_bytes(storage.join(s3_storage, "k.txt"))
    assert s3_storage in str(err.value)
    assert "wrong-secret-value-xyz" not in str(err.value)
    assert storage.redact("key=wrong-secret-value-xyz") == "key=***"


class _Flaky:
    """Failure injection: a filesystem whose first ``failures`` input streams raise a transient OSError."""

    def __init__(self, fs: pafs.FileSystem, failures: int) -> None:
        self.fs, self.failures, self.calls = fs, failures, 0

    def open_input_stream(self, path: str):
        self.calls += 1
        if self.calls <= self.failures:
            raise OSError("AWS Error NETWORK_CONNECTION: connection reset (injected)")
        return self.fs.open_input_stream(path)


def test_s3_transient_errors_are_retried(s3_storage, monkeypatch):
    uri = storage.join(s3_storage, "flaky.bin")
    storage.write_bytes(uri, b"ok")
    fs, path = storage.resolve(uri)
    flaky = _Flaky(fs, failures=2)
    monkeypatch.setattr(storage, "resolve", lambda u: (flaky, path))
    storage.configure(StorageConfig(endpoint_url=storage.s3_endpoint(), retries=2))
    assert storage.read_bytes(uri) == b"ok"
    assert flaky.calls == 3
    flaky.calls, flaky.failures = 0, 5
    with pytest.raises(storage.StorageError, match="failed after 3 attempt"):
        storage.read_bytes(uri)


def test_ensure_bucket_creates_once(s3_storage):
    uri = "s3://puma-extra-bucket/some/key.txt"
    storage.ensure_bucket(uri)
    storage.ensure_bucket(uri)  # idempotent
    storage.write_text(uri, "x")
    assert storage.read_text(uri) == "x"
    names = {b["Name"] for b in storage.boto3_client().list_buckets()["Buckets"]}
    assert {"puma-test", "puma-extra-bucket"} <= names
