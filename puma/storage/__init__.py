"""The one storage layer: every URI (local path or ``s3://bucket/key``) goes through here.

S3 settings come from ``configure(settings)`` (a ``puma.config.StorageConfig``, or what
``current_config()`` returned in another process) or the environment (``AWS_ENDPOINT_URL``,
``AWS_REGION``); credentials come only from the standard AWS chain and are never logged.
Nothing else in the project talks to S3 directly.

One retry policy (``RetryPolicy``, set by ``storage.retry.*``) for every call made here:

- transient errors (connection refused or reset, timeouts, HTTP 5xx, throttling) are retried with
  capped exponential backoff and equal jitter, and no retry starts after ``max_elapsed_s``;
- permanent errors (credentials refused, 401/403, a missing bucket, an endpoint that is not an S3
  endpoint, an unknown host) fail on the first attempt; a missing object is ``FileNotFoundError``.

Attempts never multiply: the pyarrow filesystem used here and the boto3 client make one attempt
per call. Filesystems handed to Ray have exactly one retrying layer each: Ray Data retries its own
reads (``DataContext.retried_io_errors``), so ``ray_filesystem`` makes one attempt; Ray Train and
Tune do not retry, so ``ray_storage`` gives pyarrow's standard strategy ``max_attempts``.

``preflight`` checks, before a job starts Ray, that the endpoint is well formed and answers, that
credentials are found and accepted, and that every bucket (and every input) the job names exists.

The package, one job a module (lowest first; each imports only those above it):

- ``uris``: is_s3, join, bucket_of, display_uri (string work, no I/O);
- ``settings``: StorageError, RetryPolicy, configure / current_config, the endpoint and region;
- ``filesystems``: resolve, absolute, the pyarrow filesystems (ours and Ray's), boto3 clients;
- ``credentials``: where the AWS chain finds credentials; redact;
- ``failures``: classify an error into a kind (UNREACHABLE, BUSY, DENIED, ...); the one-line message;
- ``retry``: call, one operation under the retry policy;
- ``objects``: read, write, exists, makedirs, delete, sha256 of whole objects;
- ``listing``: list_files, list_file_stats, list_dirs, FileStat;
- ``stats``: stat_files / stat_arrays, many files stamped in few requests;
- ``streams``: iter_chunks, open_stream, open_file;
- ``buckets``: preflight, ensure_bucket.

Callers use this package only (``from puma import storage``; ``storage.join(...)``). The few names
defined here rather than in a module (LIST_PAGE, write_text, stat_files, stat_arrays) read or call
what a test may patch on ``puma.storage`` (``write_bytes``, ``LIST_PAGE``), so that the patch
reaches them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from puma.storage import stats as _stats
from puma.storage.buckets import ensure_bucket, preflight
from puma.storage.credentials import credentials_source, redact
from puma.storage.failures import (
    BAD_ENDPOINT,
    BUSY,
    DENIED,
    NO_BUCKET,
    NO_CREDENTIALS,
    OTHER,
    TRANSIENT,
    UNREACHABLE,
    Failure,
    classify,
)
from puma.storage.filesystems import (
    absolute,
    boto3_client,
    ray_filesystem,
    ray_storage,
    resolve,
    s3_filesystem,
)
from puma.storage.listing import FileStat, list_dirs, list_file_stats, list_files
from puma.storage.objects import delete, exists, makedirs, read_bytes, read_text, sha256, write_bytes
from puma.storage.retry import call
from puma.storage.settings import (
    SCHEMES,
    RetryPolicy,
    StorageError,
    configure,
    configure_once,
    configured,
    current_config,
    describe_endpoint,
    endpoint_problem,
    s3_endpoint,
    s3_region,
)
from puma.storage.settings import _S3Settings as _S3Settings  # tests build one
from puma.storage.streams import iter_chunks, open_file, open_stream
from puma.storage.uris import bucket_of, display_uri, is_s3, join

__all__ = [
    "BAD_ENDPOINT", "BUSY", "DENIED", "LIST_PAGE", "NO_BUCKET", "NO_CREDENTIALS", "OTHER", "SCHEMES",
    "TRANSIENT", "UNREACHABLE", "Failure", "FileStat", "RetryPolicy", "StorageError", "absolute",
    "boto3_client", "bucket_of", "call", "classify", "configure", "configure_once", "configured",
    "credentials_source", "current_config", "delete", "describe_endpoint", "display_uri", "endpoint_problem",
    "ensure_bucket",
    "exists", "is_s3", "iter_chunks", "join", "list_dirs", "list_file_stats", "list_files", "makedirs",
    "open_file", "open_stream", "preflight", "ray_filesystem", "ray_storage", "read_bytes", "read_text",
    "redact", "resolve", "s3_endpoint", "s3_filesystem", "s3_region", "sha256", "stat_arrays", "stat_files",
    "write_bytes", "write_text",
]

LIST_PAGE = 1000  # objects an S3 LIST request returns at most (read at each call: a test may lower it)


def write_text(uri: str, text: str) -> None:
    """Write ``text`` as UTF-8 to ``uri``, through this package's ``write_bytes``."""
    write_bytes(uri, text.encode("utf-8"))


def stat_files(uris: Sequence[str]) -> list[FileStat | None]:
    """Each file's size and write time (None where it is missing), in as few requests as it takes
    (``stats.stat_files``, listing LIST_PAGE keys a request)."""
    return _stats.stat_files(uris, LIST_PAGE)


def stat_arrays(uris: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``stat_files`` as arrays: sizes (N,) int64, write times (N,) int64 ns, found (N,) bool."""
    return _stats.stat_arrays(uris, LIST_PAGE)
