"""The one retry policy applied: ``call`` runs one storage operation, retrying transient S3 errors
with capped exponential backoff and equal jitter (``RetryPolicy``, set by ``storage.retry.*``), and
turns every other failure into one ``StorageError``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

from puma.storage.credentials import redact
from puma.storage.failures import TRANSIENT, classify, failure_message
from puma.storage.settings import RetryPolicy, StorageError, in_force
from puma.storage.uris import is_s3

T = TypeVar("T")
_rng = random.Random()


def call(what: str, uri: str, fn: Callable[[], T], policy: RetryPolicy | None = None) -> T:
    """``fn()`` under the retry policy: transient errors retried (S3 only), others raised at once.

    A missing file stays ``FileNotFoundError``; every other failure becomes one ``StorageError``
    naming ``what``, the URI, the endpoint, what failed and what to do.
    """
    policy = policy or in_force.retry
    attempts = max(1, policy.max_attempts) if is_s3(uri) else 1
    start = time.monotonic()
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except (FileNotFoundError, StorageError):
            raise
        except Exception as exc:  # noqa: BLE001 - storage errors sorted below, any other re-raised
            if not _is_storage_error(exc):
                raise
            failure = classify(exc)
            wait = policy.backoff(attempt - 1, _rng)
            elapsed = time.monotonic() - start
            if failure.kind not in TRANSIENT or attempt == attempts or elapsed + wait > policy.max_elapsed_s:
                raise StorageError(redact(failure_message(what, uri, failure, attempt, elapsed))) from exc
            time.sleep(wait)
    raise AssertionError("unreachable")


def _is_storage_error(exc: BaseException) -> bool:
    """An I/O error of pyarrow or the OS, or a botocore error (not, e.g., a Parquet format error)."""
    return isinstance(exc, OSError) or type(exc).__module__.startswith("botocore")
