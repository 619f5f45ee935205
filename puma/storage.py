"""The one storage layer: every URI (local path or ``s3://bucket/key``) goes through here.

S3 settings come from ``configure(settings)`` (a ``puma.config.StorageConfig``, or what
``current_config()`` returned in another process) or the environment (``AWS_ENDPOINT_URL``,
``AWS_REGION``); credentials come only from the standard AWS chain and are never logged.
Nothing else in the project talks to S3 directly.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pyarrow.fs as pafs

T = TypeVar("T")


class StorageError(OSError):
    """A storage operation failed; the message names the URI and what to check."""


@dataclass
class _S3Settings:
    endpoint_url: str = ""
    region: str = ""
    retries: int = 5


_settings = _S3Settings()
_fs_cache: dict[tuple, pafs.FileSystem] = {}


def configure(cfg) -> None:
    """Apply S3 settings (``endpoint_url``, ``region``, ``retries``: a StorageConfig) to this process."""
    _settings.endpoint_url = cfg.endpoint_url
    _settings.region = cfg.region
    _settings.retries = cfg.retries
    _fs_cache.clear()


def s3_endpoint() -> str:
    """The S3 endpoint override in force ('' for AWS itself)."""
    return _settings.endpoint_url or os.environ.get("AWS_ENDPOINT_URL", "")


def s3_region() -> str:
    return _settings.region or os.environ.get("AWS_REGION", os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))


def is_s3(uri: str) -> bool:
    return str(uri).startswith("s3://")


def join(uri: str, *parts: str) -> str:
    """Join path parts onto a URI with '/' (local paths keep OS semantics)."""
    if is_s3(uri):
        return posixpath.join(str(uri), *parts)
    return str(Path(uri).joinpath(*parts))


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and in-filesystem path for ``uri``."""
    uri = str(uri)
    if is_s3(uri):
        return s3_filesystem(), uri[len("s3://"):].rstrip("/")
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    return _local_fs(), str(Path(uri).expanduser().absolute())


def _local_fs() -> pafs.FileSystem:
    key = ("local",)
    if key not in _fs_cache:
        _fs_cache[key] = pafs.LocalFileSystem()
    return _fs_cache[key]


def s3_filesystem() -> pafs.S3FileSystem:
    """A pyarrow S3 filesystem with the configured endpoint, region and retry strategy."""
    endpoint = s3_endpoint()
    key = ("s3", endpoint, s3_region(), _settings.retries)
    if key not in _fs_cache:
        kwargs: dict = {"region": s3_region(),
                        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=_settings.retries + 1)}
        if endpoint:
            scheme, _, host = endpoint.partition("://")
            kwargs.update(endpoint_override=host or scheme, scheme=scheme if host else "https")
        _fs_cache[key] = pafs.S3FileSystem(**kwargs)
    return _fs_cache[key]


def ray_filesystem(uri: str) -> pafs.FileSystem | None:
    """The filesystem to hand to ``ray.data.read_*`` / ``write_*`` for ``uri`` (None for local)."""
    return s3_filesystem() if is_s3(uri) else None


def _retry(what: str, uri: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` with exponential back-off on transient errors; raise StorageError at the end."""
    attempts = max(1, _settings.retries + 1) if is_s3(uri) else 1
    for attempt in range(attempts):
        try:
            return fn()
        except FileNotFoundError:
            raise
        except OSError as exc:  # pyarrow raises OSError subclasses for S3 failures
            if attempt + 1 == attempts:
                raise StorageError(f"{what} {uri} failed after {attempts} attempt(s): {exc}. "
                                   f"Check the URI, the endpoint ({s3_endpoint() or 'AWS'}) and that "
                                   f"credentials are available in the AWS chain.") from exc
            time.sleep(min(0.2 * 2 ** attempt, 5.0))
    raise AssertionError("unreachable")


def read_bytes(uri: str) -> bytes:
    """The whole object at ``uri``."""
    fs, path = resolve(uri)

    def _read() -> bytes:
        try:
            with fs.open_input_stream(path) as f:
                return f.read()
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"no object at {uri}") from exc

    return _retry("reading", uri, _read)


def read_text(uri: str) -> str:
    return read_bytes(uri).decode("utf-8")


def write_bytes(uri: str, data: bytes) -> None:
    """Write ``data`` to ``uri`` (parents created; local writes are atomic via rename)."""
    fs, path = resolve(uri)
    if not is_s3(uri):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        Path(tmp).write_bytes(data)
        os.replace(tmp, path)
        return

    def _write() -> None:
        with fs.open_output_stream(path) as f:
            f.write(data)

    _retry("writing", uri, _write)


def write_text(uri: str, text: str) -> None:
    write_bytes(uri, text.encode("utf-8"))


def exists(uri: str) -> bool:
    fs, path = resolve(uri)
    info = _retry("checking", uri, lambda: fs.get_file_info(path))
    return info.type != pafs.FileType.NotFound


def makedirs(uri: str) -> None:
    """Create a directory (a no-op prefix on S3)."""
    if not is_s3(uri):
        fs, path = resolve(uri)
        fs.create_dir(path, recursive=True)


def list_files(uri: str, suffix: str = "", recursive: bool = True) -> list[str]:
    """Sorted URIs of the files under ``uri`` ending in ``suffix`` ([] if it does not exist)."""
    fs, path = resolve(uri)
    selector = pafs.FileSelector(path, recursive=recursive, allow_not_found=True)
    infos = _retry("listing", uri, lambda: fs.get_file_info(selector))
    files = [i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(suffix)]
    return sorted(_to_uri(uri, p) for p in files)


def list_dirs(uri: str) -> list[str]:
    """Sorted URIs of the immediate sub-directories (prefixes) of ``uri``."""
    fs, path = resolve(uri)
    selector = pafs.FileSelector(path, recursive=False, allow_not_found=True)
    infos = _retry("listing", uri, lambda: fs.get_file_info(selector))
    return sorted(_to_uri(uri, i.path) for i in infos if i.type == pafs.FileType.Directory)


def _to_uri(base_uri: str, fs_path: str) -> str:
    return f"s3://{fs_path}" if is_s3(base_uri) else fs_path


def delete(uri: str) -> None:
    """Delete a file or a directory tree (missing is fine)."""
    fs, path = resolve(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.Directory:
        fs.delete_dir(path)
    elif info.type == pafs.FileType.File:
        fs.delete_file(path)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def iter_chunks(uri: str, chunk: int = 1 << 20) -> Iterator[bytes]:
    """Stream an object in chunks (for checksums of large files)."""
    fs, path = resolve(uri)
    with fs.open_input_stream(path) as f:
        while True:
            block = f.read(chunk)
            if not block:
                return
            yield block


def redact(text: str) -> str:
    """Remove anything that looks like an AWS secret from ``text`` before logging it."""
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID"):
        value = os.environ.get(name)
        if value:
            text = text.replace(value, "***")
    return text


def current_config() -> _S3Settings:
    """The S3 settings in force in this process, to hand to Ray tasks and actors (``configure`` them)."""
    return _S3Settings(endpoint_url=s3_endpoint(), region=s3_region(), retries=_settings.retries)


def boto3_client(service: str = "s3"):
    """A boto3 client for the configured endpoint and region, with standard-mode retries.

    Credentials come from the standard AWS chain (environment, shared files, instance role).
    """
    import boto3
    from botocore.config import Config as BotoConfig

    retries = {"max_attempts": _settings.retries + 1, "mode": "standard"}
    return boto3.client(service, endpoint_url=s3_endpoint() or None, region_name=s3_region(),
                        config=BotoConfig(retries=retries))


def ensure_bucket(uri: str) -> None:
    """Create the bucket of an s3:// URI if it does not exist (a no-op for local paths)."""
    if not is_s3(uri):
        return
    bucket = uri[len("s3://"):].split("/", 1)[0]
    client = boto3_client()
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    if bucket not in existing:
        region = s3_region()
        extra = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
        client.create_bucket(Bucket=bucket, **extra)


def absolute(uri: str) -> str:
    """``uri`` with a local path made absolute, so that other processes (Ray workers) find it."""
    return str(uri) if is_s3(uri) else resolve(uri)[1]
