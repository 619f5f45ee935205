"""Buckets before a job: ``preflight`` checks, before a job starts Ray, that the endpoint is well
formed and answers, that credentials are found and accepted, and that every bucket (and every input)
the job names exists; ``ensure_bucket`` creates a missing bucket.
"""

from __future__ import annotations

from collections.abc import Iterable

from puma.storage.credentials import credentials_source
from puma.storage.failures import NO_CREDENTIALS, Failure, failure_message
from puma.storage.filesystems import boto3_client
from puma.storage.retry import call
from puma.storage.settings import StorageError, checked_endpoint, configure, describe_endpoint, s3_region
from puma.storage.uris import bucket_of, is_s3


def preflight(settings=None, inputs: Iterable[str] = (), outputs: Iterable[str] = ()) -> int:
    """Check the S3 locations a job will use before it starts Ray; returns how many were checked.

    ``settings`` (a StorageConfig) is applied first. ``inputs`` must hold an object or a folder;
    ``outputs`` (and any location that may not exist yet) need only their bucket. For each s3:// URI
    among them: the endpoint is well formed, credentials are found in the AWS chain, and one listing
    is answered, which proves the endpoint, the credentials and the bucket. Local paths and '' are
    skipped. Raises StorageError (one line, naming the URI and the endpoint).
    """
    if settings is not None:
        configure(settings)
    checks = {str(u): True for u in inputs if is_s3(u)}
    for uri in outputs:
        if is_s3(uri):
            checks.setdefault(str(uri), False)
    if not checks:
        return 0
    checked_endpoint()
    client = None
    for uri, must_exist in checks.items():
        if client is None:
            if not credentials_source():
                raise StorageError(failure_message("checking", uri, Failure(NO_CREDENTIALS, ""), 1, 0.0))
            client = boto3_client()
        _check_location(client, uri, must_exist)
    return len(checks)


def _check_location(client, uri: str, must_exist: bool) -> None:
    """One listing of the URI's prefix: endpoint, credentials and bucket; inputs must hold something."""
    bucket, _, key = str(uri)[len("s3://"):].partition("/")
    key = key.rstrip("/")
    found = call("checking", uri, lambda: client.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1))
    if must_exist and key and not found.get("KeyCount", 0):
        raise StorageError(f"checking {uri} failed: nothing there (no object, no folder) at endpoint "
                           f"{describe_endpoint()}; check the URI")


def ensure_bucket(uri: str) -> None:
    """Create the bucket of an s3:// URI if it does not exist (a no-op for local paths)."""
    if not is_s3(uri):
        return
    bucket = bucket_of(uri)
    client = boto3_client()
    existing = {b["Name"] for b in call("listing buckets for", uri, client.list_buckets).get("Buckets", [])}
    if bucket not in existing:
        region = s3_region()
        extra = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
        call("creating the bucket of", uri, lambda: client.create_bucket(Bucket=bucket, **extra))
