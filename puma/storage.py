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
"""

from __future__ import annotations

import bisect
import calendar
import hashlib
import io
import os
import posixpath
import random
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from puma.errors import UserError

T = TypeVar("T")
SCHEMES = ("http://", "https://")


class StorageError(UserError, OSError):
    """A storage operation failed; the message names the URI, the endpoint, what failed and what to do."""


# ----------------------------------------------------------------------------- settings


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


_settings = _S3Settings()
_configured = False  # configure() ran in this process: a Ray worker may not reach S3 before it has
_fs_cache: dict[tuple, pafs.FileSystem] = {}
_rng = random.Random()


def configure(cfg) -> None:
    """Apply S3 settings (a StorageConfig, or what ``current_config()`` returned) to this process.

    The settings travel with the work: a driver hands ``current_config()`` to each Ray task, actor or
    replica it starts, and that calls ``configure`` with it first. A Ray worker process that reaches
    S3 without having done so fails (StorageError) rather than use the default endpoint silently."""
    global _configured
    retry = cfg.retry
    _settings.endpoint_url = cfg.endpoint_url
    _settings.region = cfg.region
    _settings.connect_timeout_s = cfg.connect_timeout_s
    _settings.retry = RetryPolicy(max_attempts=retry.max_attempts, initial_backoff_s=retry.initial_backoff_s,
                                  max_backoff_s=retry.max_backoff_s, max_elapsed_s=retry.max_elapsed_s)
    _fs_cache.clear()
    _configured = True


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
                       connect_timeout_s=_settings.connect_timeout_s, retry=_settings.retry)


def s3_endpoint() -> str:
    """The S3 endpoint override in force ('' for AWS itself)."""
    return _settings.endpoint_url or os.environ.get("AWS_ENDPOINT_URL", "")


def s3_region() -> str:
    return _settings.region or os.environ.get("AWS_REGION", os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))


def endpoint_problem(endpoint: str) -> str:
    """Why ``endpoint`` cannot be an S3 endpoint URL ('' when it can)."""
    if endpoint and not endpoint.startswith(SCHEMES):
        return (f"{endpoint!r} has no scheme: write http://{endpoint} for a server without TLS (a local "
                f"SeaweedFS or MinIO) or https://{endpoint}")
    if endpoint and not endpoint.split("://", 1)[1].strip("/"):
        return f"{endpoint!r} names no host"
    return ""


def _endpoint() -> str:
    """The endpoint in force, checked: a scheme-less AWS_ENDPOINT_URL is an error, not https, and a Ray
    worker must have been handed the driver's settings."""
    _check_configured()
    endpoint = s3_endpoint()
    problem = endpoint_problem(endpoint)
    if problem:
        source = "storage.endpoint_url" if _settings.endpoint_url else "AWS_ENDPOINT_URL"
        raise StorageError(f"{source}={problem}")
    return endpoint


def describe_endpoint() -> str:
    """The endpoint for messages: its URL, or AWS S3 and the region."""
    return s3_endpoint() or f"AWS S3 ({s3_region()})"


# ----------------------------------------------------------------------------- URIs


def is_s3(uri: str) -> bool:
    return str(uri).startswith("s3://")


def join(uri: str, *parts: str) -> str:
    """Join path parts onto a URI with '/' (local paths keep OS semantics)."""
    if is_s3(uri):
        return posixpath.join(str(uri), *parts)
    return str(Path(uri).joinpath(*parts))


def bucket_of(uri: str) -> str:
    """The bucket of an s3:// URI."""
    return str(uri)[len("s3://"):].split("/", 1)[0]


def display_uri(path: str, filesystem: pafs.FileSystem | None = None) -> str:
    """A location as users see it everywhere: ``s3://bucket/key`` for S3 paths (pyarrow and Ray
    drop the scheme), local paths unchanged."""
    path = str(path)
    if filesystem is not None and filesystem.type_name == "s3" and not is_s3(path):
        return "s3://" + path.lstrip("/")
    return path


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and in-filesystem path for ``uri`` (calls on it are not retried:
    wrap them in ``call``)."""
    uri = str(uri)
    if is_s3(uri):
        return s3_filesystem(), uri[len("s3://"):].rstrip("/")
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    return _local_fs(), str(Path(uri).expanduser().absolute())


def absolute(uri: str) -> str:
    """``uri`` with a local path made absolute, so that other processes (Ray workers) find it."""
    return str(uri) if is_s3(uri) else resolve(uri)[1]


# ----------------------------------------------------------------------------- filesystems


def _local_fs() -> pafs.FileSystem:
    key = ("local",)
    if key not in _fs_cache:
        _fs_cache[key] = pafs.LocalFileSystem()
    return _fs_cache[key]


def _pyarrow_s3(attempts: int) -> pafs.S3FileSystem:
    """A pyarrow S3 filesystem for the settings in force, making up to ``attempts`` attempts per call."""
    endpoint = _endpoint()
    key = ("s3", endpoint, s3_region(), _settings.connect_timeout_s, attempts)
    if key not in _fs_cache:
        kwargs: dict = {"region": s3_region(), "connect_timeout": _settings.connect_timeout_s,
                        "allow_delayed_open": True,  # small objects: one PUT, not a multipart upload
                        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=attempts)}
        if endpoint:
            scheme, host = endpoint.split("://", 1)
            kwargs.update(endpoint_override=host.rstrip("/"), scheme=scheme)
        _fs_cache[key] = pafs.S3FileSystem(**kwargs)
    return _fs_cache[key]


def s3_filesystem() -> pafs.S3FileSystem:
    """The pyarrow S3 filesystem used by this module: one attempt per call (``call`` retries)."""
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
    return str(uri)[len("s3://"):].rstrip("/"), _pyarrow_s3(max(1, _settings.retry.max_attempts))


def boto3_client(service: str = "s3"):
    """A boto3 client for the configured endpoint and region; one attempt per call (``call`` retries).

    Credentials come from the standard AWS chain (environment, shared files, instance role), read
    afresh for each client.
    """
    import boto3
    from botocore.config import Config as BotoConfig

    config = BotoConfig(retries={"total_max_attempts": 1, "mode": "standard"},
                        connect_timeout=_settings.connect_timeout_s, read_timeout=60)
    return boto3.session.Session().client(service, endpoint_url=_endpoint() or None, region_name=s3_region(),
                                          config=config)


# ----------------------------------------------------------------------------- errors and retries

UNREACHABLE, BUSY, DENIED, NO_BUCKET, BAD_ENDPOINT, NO_CREDENTIALS, OTHER = (
    "unreachable", "busy", "denied", "no_bucket", "bad_endpoint", "no_credentials", "other")
TRANSIENT = (UNREACHABLE, BUSY)  # the kinds that are retried
_DENIED_CODES = ("ACCESS_DENIED", "SIGNATURE_DOES_NOT_MATCH", "INVALID_ACCESS_KEY_ID", "ACCESSDENIED",
                 "SIGNATUREDOESNOTMATCH", "INVALIDACCESSKEYID", "EXPIRED_TOKEN", "EXPIREDTOKEN",
                 "INVALID_TOKEN", "INVALIDTOKEN", "MISSING_AUTHENTICATION_TOKEN", "UNRECOGNIZED_CLIENT",
                 "INVALIDCLIENTTOKENID", "AUTHORIZATIONHEADERMALFORMED", "403", "401")
_TRANSIENT_CODES = ("SLOW_DOWN", "SLOWDOWN", "THROTTLING", "THROTTLED", "REQUEST_LIMIT_EXCEEDED",
                    "REQUESTLIMITEXCEEDED", "SERVICE_UNAVAILABLE", "SERVICEUNAVAILABLE", "INTERNAL_FAILURE",
                    "INTERNALERROR", "REQUEST_TIMEOUT", "REQUESTTIMEOUT",
                    "500", "502", "503", "504")
# curl codes (pyarrow's AWS SDK) that mean the endpoint itself is wrong, not briefly unreachable
_BAD_ENDPOINT_CURL = {"1": "unsupported protocol", "3": "malformed URL", "6": "unknown host",
                      "35": "TLS handshake failed", "51": "TLS certificate rejected",
                      "58": "TLS certificate problem", "60": "TLS certificate not trusted"}


@dataclass(frozen=True)
class Failure:
    """What went wrong in one call: a kind (UNREACHABLE, BUSY, DENIED, ...) and a short reason."""

    kind: str
    reason: str


def classify(exc: BaseException) -> Failure:
    """Sort a pyarrow / boto3 / OS error into a kind; only the TRANSIENT kinds are retried."""
    if type(exc).__module__.startswith("botocore"):
        return _classify_boto(exc)
    text = str(exc)
    curl = re.search(r"curlCode: (\d+), ([^;]+)", text)
    if curl and curl.group(1) in _BAD_ENDPOINT_CURL:
        return Failure(BAD_ENDPOINT, f"{_BAD_ENDPOINT_CURL[curl.group(1)]}: {curl.group(2).strip()}")
    code = re.search(r"AWS Error (\w+)", text)
    status = re.search(r"HTTP status (\d{3})", text)
    return _classify_code(code.group(1) if code else "", status.group(1) if status else "",
                          curl.group(2).strip() if curl else _first_line(text), bool(curl or code))


def _classify_code(code: str, status: str, detail: str, is_s3_error: bool) -> Failure:
    """The kind of an S3 error code / HTTP status (pyarrow spells codes LIKE_THIS, S3 LikeThis)."""
    upper = code.upper()
    if upper in ("NO_SUCH_BUCKET", "NOSUCHBUCKET"):
        return Failure(NO_BUCKET, "the bucket does not exist")
    if upper in _DENIED_CODES or status in ("401", "403"):
        return Failure(DENIED, ", ".join(x for x in (code, f"HTTP {status}" if status else "") if x))
    if upper == "NETWORK_CONNECTION" or (is_s3_error and upper == "UNKNOWN" and not status):
        return Failure(UNREACHABLE, detail)  # no HTTP answer: the connection failed or broke
    if upper in _TRANSIENT_CODES or status.startswith("5"):
        return Failure(BUSY, " ".join(x for x in (code, f"HTTP {status}" if status else "") if x))
    return Failure(OTHER, detail)


def _classify_boto(exc: BaseException) -> Failure:
    from botocore import exceptions as be

    if isinstance(exc, be.NoCredentialsError):
        return Failure(NO_CREDENTIALS, "no credentials found in the AWS chain")
    if isinstance(exc, be.SSLError):
        ssl = re.search(r"\[SSL: \w+\] ([^(]+)", str(exc))
        detail = ssl.group(1).strip() if ssl else _first_line(str(exc))
        return Failure(BAD_ENDPOINT, f"TLS handshake failed: {detail}")
    if isinstance(exc, be.EndpointConnectionError):
        cause = str(getattr(exc, "kwargs", {}).get("error", ""))
        if "NameResolution" in cause or "Name or service not known" in cause or "nodename nor" in cause:
            return Failure(BAD_ENDPOINT, "unknown host")
        return Failure(UNREACHABLE, "could not connect to the server")
    if isinstance(exc, (be.ConnectTimeoutError, be.ReadTimeoutError, be.ConnectionClosedError)):
        return Failure(UNREACHABLE, type(exc).__name__)
    if isinstance(exc, be.ClientError):
        error = exc.response.get("Error", {})
        status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        return _classify_code(str(error.get("Code", "")), status, _first_line(str(exc)), True)
    return Failure(OTHER, _first_line(str(exc)))


def _first_line(text: str) -> str:
    return " ".join(text.split())[:300]


def call(what: str, uri: str, fn: Callable[[], T], policy: RetryPolicy | None = None) -> T:
    """``fn()`` under the retry policy: transient errors retried (S3 only), others raised at once.

    A missing file stays ``FileNotFoundError``; every other failure becomes one ``StorageError``
    naming ``what``, the URI, the endpoint, what failed and what to do.
    """
    policy = policy or _settings.retry
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
                raise StorageError(redact(_message(what, uri, failure, attempt, elapsed))) from exc
            time.sleep(wait)
    raise AssertionError("unreachable")


def _is_storage_error(exc: BaseException) -> bool:
    """An I/O error of pyarrow or the OS, or a botocore error (not, e.g., a Parquet format error)."""
    return isinstance(exc, OSError) or type(exc).__module__.startswith("botocore")


_ADVICE = {  # what failed and what to do, per kind of failure
    UNREACHABLE: "cannot reach {where} ({reason}; {tries}); check that the server is up and that "
                 "storage.endpoint_url (or AWS_ENDPOINT_URL) points at it; {bound}",
    BUSY: "{where} kept answering with server errors ({reason}; {tries}); try again later or raise "
          "storage.retry.max_attempts ({bound})",
    DENIED: "{where} refused the credentials ({reason}; credentials from {source}); check "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and that they may access bucket "
            "{bucket}",
    NO_BUCKET: "bucket {bucket!r} does not exist at {where}; create it (aws s3 mb s3://{bucket}{flag}) or "
               "fix the URI",
    BAD_ENDPOINT: "{where} is not a working S3 endpoint ({reason}); check the scheme (http:// for a server "
                  "without TLS), host and port of storage.endpoint_url (or AWS_ENDPOINT_URL)",
    NO_CREDENTIALS: "no AWS credentials found (environment, ~/.aws/credentials, AWS_PROFILE, instance or "
                    "pod role); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or AWS_PROFILE ({where})",
    OTHER: "{reason} ({where})",
}


def _message(what: str, uri: str, failure: Failure, attempts: int, seconds: float) -> str:
    """One line: what failed, where, why, and what to do."""
    if not is_s3(uri):
        return f"{what} {uri} failed: {failure.reason}"
    source = credentials_source() if failure.kind == DENIED else ""
    fields = {"where": f"endpoint {describe_endpoint()}", "reason": failure.reason, "bucket": bucket_of(uri),
              "tries": f"{attempts} attempt{'s' if attempts > 1 else ''} in {seconds:.1f} s",
              "bound": f"storage.retry.max_elapsed_s={_settings.retry.max_elapsed_s:g} bounds the wait",
              "source": _CREDENTIAL_SOURCES.get(source, source or "nowhere"), "flag": _endpoint_flag()}
    return f"{what} {uri} failed: " + _ADVICE[failure.kind].format(**fields)


_CREDENTIAL_SOURCES = {"env": "the environment", "shared-credentials-file": "~/.aws/credentials",
                       "config-file": "~/.aws/config", "iam-role": "the instance role",
                       "container-role": "the container role", "assume-role": "an assumed role",
                       "assume-role-with-web-identity": "a web identity (IRSA)", "sso": "AWS SSO"}


def _endpoint_flag() -> str:
    return f" --endpoint-url {s3_endpoint()}" if s3_endpoint() else ""


def credentials_source() -> str:
    """Where the AWS chain finds credentials: 'env', 'shared-credentials-file', 'iam-role', ... ('': none)."""
    import boto3

    creds = boto3.session.Session().get_credentials()
    return "" if creds is None else str(getattr(creds, "method", "") or "the AWS chain")


# ----------------------------------------------------------------------------- reading and writing


def read_bytes(uri: str) -> bytes:
    """The whole object at ``uri``."""
    fs, path = resolve(uri)

    def _read() -> bytes:
        try:
            with fs.open_input_stream(path) as f:
                return f.read()
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"no object at {uri}") from exc

    return call("reading", uri, _read)


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

    call("writing", uri, _write)


def write_text(uri: str, text: str) -> None:
    write_bytes(uri, text.encode("utf-8"))


def exists(uri: str) -> bool:
    fs, path = resolve(uri)
    info = call("checking", uri, lambda: fs.get_file_info(path))
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
    infos = call("listing", uri, lambda: fs.get_file_info(selector))
    files = [i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(suffix)]
    return sorted(_to_uri(uri, p) for p in files)


@dataclass(frozen=True)
class FileStat:
    """What a listing says of a file: where, how many bytes, when it was last written (ns)."""

    uri: str
    size: int
    mtime_ns: int

    @property
    def stamp(self) -> str:
        """``<size>:<mtime_ns>``: changes whenever the file is rewritten (the quick change check)."""
        return f"{self.size}:{self.mtime_ns}"


def list_file_stats(uri: str, suffix: str = "", recursive: bool = True) -> list[FileStat]:
    """The files under ``uri`` ending in ``suffix``, sorted, with their sizes and write times, from
    the listing alone (no file is opened; [] if ``uri`` does not exist)."""
    fs, path = resolve(uri)
    selector = pafs.FileSelector(path, recursive=recursive, allow_not_found=True)
    infos = call("listing", uri, lambda: fs.get_file_info(selector))
    stats = [FileStat(_to_uri(uri, i.path), int(i.size or 0), _mtime_ns(i)) for i in infos
             if i.type == pafs.FileType.File and i.path.endswith(suffix)]
    return sorted(stats, key=lambda s: s.uri)


LIST_PAGE = 1000  # objects an S3 LIST request returns at most
THREADS = 16  # requests in flight when stamping S3 objects


def stat_files(uris: Sequence[str]) -> list[FileStat | None]:
    """Each file's size and write time (None where it is missing), in as few requests as it takes:
    local files in one call; S3 objects by listing the key range of their folder (one request per 1,000
    keys) where that costs fewer requests than a HEAD per object (see ``_list_folder``), the others one
    HEAD each (threads). A listed object's write time is cut to whole seconds, as a HEAD gives it, so an
    object has one stamp however it was asked."""
    sizes, times, found = stat_arrays(uris)
    return [FileStat(u, int(sizes[i]), int(times[i])) if found[i] else None for i, u in enumerate(uris)]


def stat_arrays(uris: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``stat_files`` as arrays, no object per file: sizes (N,) int64, write times (N,) int64 ns, found
    (N,) bool (False: missing, or not a file)."""
    n = len(uris)
    sizes, times, found = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, bool)
    s3 = [i for i, u in enumerate(uris) if u.startswith("s3://")]
    if len(s3) < n:
        local = [i for i, u in enumerate(uris) if not u.startswith("s3://")] if s3 else range(n)
        # an absolute path is asked as it is (resolve's pathlib per file cost 17 s at 1M files)
        infos = _local_fs().get_file_info([u if u.startswith("/") else resolve(u)[1]
                                           for u in (uris[i] for i in local)])
        for i, info in zip(local, infos, strict=True):
            size = info.size  # None for a missing file or a folder
            if size is not None:
                sizes[i], times[i], found[i] = size, info.mtime_ns or 0, True
    folders: dict[str, list[int]] = {}
    for i in s3:
        folders.setdefault(uris[i].rsplit("/", 1)[0], []).append(i)
    if folders:
        out: list[FileStat | None] = [None] * n
        _stat_s3(uris, folders, out)
        for i in s3:
            if out[i] is not None:
                sizes[i], times[i], found[i] = out[i].size, out[i].mtime_ns, True
    return sizes, times, found


def _stat(uri: str, info: pafs.FileInfo) -> FileStat | None:
    return FileStat(uri, int(info.size or 0), _mtime_ns(info)) if info.is_file else None


def _stat_s3(uris: Sequence[str], folders: dict[str, list[int]], out: list[FileStat | None]) -> None:
    """Fill ``out`` for S3 objects: list the folders naming two or more, HEAD the rest."""
    client = boto3_client() if any(len(rows) > 1 for rows in folders.values()) else None
    listed = {f: rows for f, rows in folders.items() if len(rows) > 1}
    with ThreadPoolExecutor(max_workers=THREADS) as pool:
        unlisted = pool.map(lambda f: _list_folder(client, f, [uris[i] for i in listed[f]], out, listed[f]),
                            listed)
        heads = [i for rows in unlisted for i in rows]
        heads += [rows[0] for rows in folders.values() if len(rows) == 1]

        def head(i: int) -> None:
            fs, path = resolve(uris[i])
            out[i] = _stat(uris[i], call("reading", uris[i], lambda: fs.get_file_info(path)))

        list(pool.map(head, heads))


def _list_folder(client, folder: str, uris: list[str], out: list[FileStat | None], rows: list[int]
                 ) -> list[int]:
    """List the keys of ``folder`` from its first to its last wanted object, page by page, filling ``out``;
    stop once the pages spent reach the objects still unseen (a HEAD each costs no more then). Returns
    the rows left to HEAD; a wanted object the finished listing passed without seeing is missing."""
    bucket, prefix = folder[len("s3://"):].split("/", 1) if "/" in folder[len("s3://"):] else \
        (folder[len("s3://"):], "")
    prefix = prefix + "/" if prefix else ""
    wanted = dict(zip((u[len("s3://") + len(bucket) + 1:] for u in uris), rows, strict=True))
    keys = sorted(wanted)
    args = {"Bucket": bucket, "Prefix": prefix, "Delimiter": "/", "MaxKeys": LIST_PAGE,
            "StartAfter": keys[0][:-1]}
    pages, last = 0, ""
    while True:
        page = call("listing", folder, lambda a=dict(args): client.list_objects_v2(**a))
        pages += 1
        for item in page.get("Contents", []):
            if item["Key"] in wanted:
                seconds = calendar.timegm(item["LastModified"].utctimetuple())
                out[wanted[item["Key"]]] = FileStat(f"s3://{bucket}/{item['Key']}", int(item["Size"]),
                                                    seconds * 1_000_000_000)
        last = max([last] + [c["Key"] for c in page.get("Contents", [])] +
                   [c["Prefix"] for c in page.get("CommonPrefixes", [])])
        unseen = [wanted[k] for k in keys[bisect.bisect_right(keys, last):]]
        if not page.get("IsTruncated") or not unseen:
            return []
        if pages >= len(unseen):
            return unseen
        args["ContinuationToken"] = page["NextContinuationToken"]


def _mtime_ns(info: pafs.FileInfo) -> int:
    return int(info.mtime_ns) if info.mtime_ns is not None else 0


def list_dirs(uri: str) -> list[str]:
    """Sorted URIs of the immediate sub-directories (prefixes) of ``uri``."""
    fs, path = resolve(uri)
    selector = pafs.FileSelector(path, recursive=False, allow_not_found=True)
    infos = call("listing", uri, lambda: fs.get_file_info(selector))
    return sorted(_to_uri(uri, i.path) for i in infos if i.type == pafs.FileType.Directory)


def _to_uri(base_uri: str, fs_path: str) -> str:
    return f"s3://{fs_path}" if is_s3(base_uri) else fs_path


def delete(uri: str) -> None:
    """Delete a file or a directory tree (missing is fine)."""
    fs, path = resolve(uri)

    def _delete() -> None:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.Directory:
            fs.delete_dir(path)
        elif info.type == pafs.FileType.File:
            fs.delete_file(path)

    call("deleting", uri, _delete)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def iter_chunks(uri: str, chunk: int = 1 << 20) -> Iterator[bytes]:
    """Stream an object in chunks (for checksums of large files); a broken stream resumes where it was."""
    fs, path = resolve(uri)
    state: dict = {"file": None, "pos": 0}

    def _next() -> bytes:
        try:
            if state["file"] is None:
                state["file"] = fs.open_input_file(path)
                state["file"].seek(state["pos"])
            return state["file"].read(chunk)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"no object at {uri}") from exc
        except Exception:
            _close(state)
            raise

    try:
        while True:
            block = call("reading", uri, _next)
            if not block:
                return
            state["pos"] += len(block)
            yield block
    finally:
        _close(state)


class _ChunkReader(io.RawIOBase):
    """A read-only file over ``iter_chunks``: a parser streams an object, and a broken stream resumes."""

    def __init__(self, uri: str, chunk: int) -> None:
        super().__init__()
        self._chunks = iter_chunks(uri, chunk)
        self._block, self._at = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._at == len(self._block):
            self._block, self._at = next(self._chunks, b""), 0
        n = min(len(buffer), len(self._block) - self._at)
        buffer[:n] = self._block[self._at:self._at + n]
        self._at += n
        return n

    def close(self) -> None:
        self._chunks.close()
        super().close()


def open_stream(uri: str, chunk: int = 8 << 20) -> io.BufferedReader | pa.NativeFile:
    """The object at ``uri`` as a file read front to back without holding it: a local file as it is; an
    S3 object in chunks of ``chunk`` bytes, a broken stream resuming where it was (a missing object
    raises FileNotFoundError on read)."""
    if is_s3(uri):
        return io.BufferedReader(_ChunkReader(uri, chunk), buffer_size=chunk)
    fs, path = resolve(uri)
    try:
        return fs.open_input_stream(path)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"no object at {uri}") from exc


def open_file(uri: str) -> pa.NativeFile:
    """The object at ``uri`` opened for random access (a Parquet file read part by part)."""
    fs, path = resolve(uri)

    def _open() -> pa.NativeFile:
        try:
            return fs.open_input_file(path)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"no object at {uri}") from exc

    return call("reading", uri, _open)


def _close(state: dict) -> None:
    if state["file"] is not None:
        state["file"].close()
        state["file"] = None


def redact(text: str) -> str:
    """Remove anything that looks like an AWS secret from ``text`` before logging it."""
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID"):
        value = os.environ.get(name)
        if value:
            text = text.replace(value, "***")
    return text


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


# ----------------------------------------------------------------------------- preflight


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
    _endpoint()
    client = None
    for uri, must_exist in checks.items():
        if client is None:
            if not credentials_source():
                raise StorageError(_message("checking", uri, Failure(NO_CREDENTIALS, ""), 1, 0.0))
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
