"""The S3 settings in force in this process (endpoint, region, connect timeout, retry policy), and
``StorageError``, the one error every storage failure becomes.

``configure`` sets them from a ``puma.config.StorageConfig`` (or what ``current_config()`` returned
in another process); unset, the environment (``AWS_ENDPOINT_URL``, ``AWS_REGION``) decides. A Ray
worker must be handed the driver's settings before it reaches S3.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass, field

import pyarrow.fs as pafs

from puma.errors import UserError

SCHEMES = ("http://", "https://")


class StorageError(UserError, OSError):
    """A storage operation failed; the message names the URI, the endpoint, what failed and what to do."""


@dataclass(frozen=True)
class RetryPolicy:
    """When and how long to retry a transient S3 error (the ``storage.retry`` section)."""

    max_attempts: int = 6
    initial_backoff_s: float = 0.25
    max_backoff_s: float = 4.0
    max_elapsed_s: float = 10.0

    def backoff(self, retry: int, rng: random.Random) -> float:
        """The wait before retry number ``retry`` (0-based): capped exponential, equal jitter."""
        cap = min(self.max_backoff_s, self.initial_backoff_s * 2 ** retry)
        return cap / 2 + rng.uniform(0.0, cap / 2)


@dataclass
class _S3Settings:
    endpoint_url: str = ""
    region: str = ""
    connect_timeout_s: float = 3.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)


in_force = _S3Settings()
_configured = False  # configure() ran in this process: a Ray worker may not reach S3 before it has
_applied: tuple = ()  # what configure() last applied: the settings and the AWS_* environment (_applied_key)
fs_cache: dict[tuple, pafs.FileSystem] = {}  # filled by filesystems.py; emptied by configure


def configure(cfg) -> None:
    """Apply S3 settings (a StorageConfig, or what ``current_config()`` returned) to this process.

    The settings travel with the work: a driver hands ``current_config()`` to each Ray task, actor or
    replica it starts, and that calls ``configure`` with it first. A Ray worker process that reaches
    S3 without having done so fails (StorageError) rather than use the default endpoint silently."""
    global _configured, _applied
    retry = cfg.retry
    in_force.endpoint_url = cfg.endpoint_url
    in_force.region = cfg.region
    in_force.connect_timeout_s = cfg.connect_timeout_s
    in_force.retry = RetryPolicy(max_attempts=retry.max_attempts, initial_backoff_s=retry.initial_backoff_s,
                                 max_backoff_s=retry.max_backoff_s, max_elapsed_s=retry.max_elapsed_s)
    fs_cache.clear()
    _configured = True
    _applied = _applied_key(cfg)


def _applied_key(cfg) -> tuple:
    """The settings of ``cfg`` and the AWS_* environment (credentials, endpoint, region) they meet."""
    retry = cfg.retry
    return (cfg.endpoint_url, cfg.region, cfg.connect_timeout_s, retry.max_attempts, retry.initial_backoff_s,
            retry.max_backoff_s, retry.max_elapsed_s,
            tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))


def configure_once(cfg) -> None:
    """``configure`` unless this process already runs with these very settings, under the same AWS_*
    environment (credentials, endpoint, region): then its S3 clients are kept."""
    if not _configured or _applied_key(cfg) != _applied:
        configure(cfg)


def _in_ray_worker() -> bool:
    """Whether this process is a Ray worker (a task, actor, Train worker or Serve replica), not a driver."""
    worker = sys.modules.get("ray._private.worker")
    return worker is not None and worker.global_worker.mode == worker.WORKER_MODE


def _check_configured() -> None:
    """S3 in a Ray worker needs the driver's settings (``configure``): refuse before guessing them."""
    if not _configured and _in_ray_worker():
        raise StorageError("S3 used in a Ray worker process before its storage settings arrived: the "
                           "code that starts this task, actor or replica must pass it the driver's "
                           "puma.storage.current_config() and call puma.storage.configure(settings) "
                           "there first (else it would use the default endpoint, not storage.endpoint_url)")


def configured() -> bool:
    """Whether ``configure`` has run in this process (a Ray worker needs it before reaching S3)."""
    return _configured


def current_config() -> _S3Settings:
    """The S3 settings in force in this process, to hand to Ray tasks and actors (``configure`` them)."""
    return _S3Settings(endpoint_url=s3_endpoint(), region=s3_region(),
                       connect_timeout_s=in_force.connect_timeout_s, retry=in_force.retry)


def s3_endpoint() -> str:
    """The S3 endpoint override in force ('' for AWS itself)."""
    return in_force.endpoint_url or os.environ.get("AWS_ENDPOINT_URL", "")


def s3_region() -> str:
    return in_force.region or os.environ.get("AWS_REGION", os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))


def endpoint_problem(endpoint: str) -> str:
    """Why ``endpoint`` cannot be an S3 endpoint URL ('' when it can)."""
    if endpoint and not endpoint.startswith(SCHEMES):
        return (f"{endpoint!r} has no scheme: write http://{endpoint} for a server without TLS (a local "
                f"SeaweedFS or MinIO) or https://{endpoint}")
    if endpoint and not endpoint.split("://", 1)[1].strip("/"):
        return f"{endpoint!r} names no host"
    return ""


def checked_endpoint() -> str:
    """The endpoint in force, checked: a scheme-less AWS_ENDPOINT_URL is an error, not https, and a Ray
    worker must have been handed the driver's settings."""
    _check_configured()
    endpoint = s3_endpoint()
    problem = endpoint_problem(endpoint)
    if problem:
        source = "storage.endpoint_url" if in_force.endpoint_url else "AWS_ENDPOINT_URL"
        raise StorageError(f"{source}={problem}")
    return endpoint


def describe_endpoint() -> str:
    """The endpoint for messages: its URL, or AWS S3 and the region."""
    return s3_endpoint() or f"AWS S3 ({s3_region()})"
