"""Filesystems and clients for a URI: the pyarrow filesystem behind ``resolve``, the ones handed to
Ray Data, Train and Tune, and boto3 clients, each built for the settings in force (and cached).

Attempts never multiply: the pyarrow filesystem used by this package and the boto3 client make one
attempt per call (``retry.call`` retries). Ray Data retries its own reads, so ``ray_filesystem``
makes one attempt; Ray Train and Tune do not retry, so ``ray_storage`` gives pyarrow's standard
strategy ``storage.retry.max_attempts``.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs

from puma.storage.settings import checked_endpoint, fs_cache, in_force, s3_region
from puma.storage.uris import is_s3


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and in-filesystem path for ``uri`` (calls on it are not retried:
    wrap them in ``call``)."""
    uri = str(uri)
    if is_s3(uri):
        return s3_filesystem(), uri[len("s3://"):].rstrip("/")
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    return local_fs(), str(Path(uri).expanduser().absolute())


def absolute(uri: str) -> str:
    """``uri`` with a local path made absolute, so that other processes (Ray workers) find it."""
    return str(uri) if is_s3(uri) else resolve(uri)[1]


def local_fs() -> pafs.FileSystem:
    """The local filesystem (one per process, like each S3 one)."""
    key = ("local",)
    if key not in fs_cache:
        fs_cache[key] = pafs.LocalFileSystem()
    return fs_cache[key]


def _pyarrow_s3(attempts: int) -> pafs.S3FileSystem:
    """A pyarrow S3 filesystem for the settings in force, making up to ``attempts`` attempts per call."""
    endpoint = checked_endpoint()
    key = ("s3", endpoint, s3_region(), in_force.connect_timeout_s, attempts)
    if key not in fs_cache:
        kwargs: dict = {"region": s3_region(), "connect_timeout": in_force.connect_timeout_s,
                        "allow_delayed_open": True,  # small objects: one PUT, not a multipart upload
                        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=attempts)}
        if endpoint:
            scheme, host = endpoint.split("://", 1)
            kwargs.update(endpoint_override=host.rstrip("/"), scheme=scheme)
        fs_cache[key] = pafs.S3FileSystem(**kwargs)
    return fs_cache[key]


def s3_filesystem() -> pafs.S3FileSystem:
    """The pyarrow S3 filesystem used by this package: one attempt per call (``call`` retries)."""
    return _pyarrow_s3(1)


def ray_filesystem(uri: str) -> pafs.FileSystem | None:
    """The filesystem to hand to ``ray.data.read_*`` / ``write_*`` for ``uri`` (None for local).

    One attempt per call: Ray Data retries transient read and write errors itself
    (``DataContext.retried_io_errors``), so retries here would multiply with its own.
    """
    return _pyarrow_s3(1) if is_s3(uri) else None


def ray_storage(uri: str) -> tuple[str, pafs.FileSystem | None]:
    """(path, filesystem) for Ray Train's / Tune's ``storage_path`` and ``storage_filesystem``.

    Ray Train and Tune do not retry checkpoint uploads and downloads, so this filesystem retries
    itself: pyarrow's standard strategy with ``storage.retry.max_attempts``.
    """
    if not is_s3(uri):
        return resolve(uri)[1], None
    return str(uri)[len("s3://"):].rstrip("/"), _pyarrow_s3(max(1, in_force.retry.max_attempts))


def boto3_client(service: str = "s3"):
    """A boto3 client for the configured endpoint and region; one attempt per call (``call`` retries).

    Credentials come from the standard AWS chain (environment, shared files, instance role), read
    afresh for each client.
    """
    import boto3
    from botocore.config import Config as BotoConfig

    config = BotoConfig(retries={"total_max_attempts": 1, "mode": "standard"},
                        connect_timeout=in_force.connect_timeout_s, read_timeout=60)
    return boto3.session.Session().client(service, endpoint_url=checked_endpoint() or None,
                                          region_name=s3_region(), config=config)
