"""What went wrong in a storage call: a pyarrow / boto3 / OS error sorted into a kind, and the one-line
message naming the URI, the endpoint, what failed and what to do.

Transient kinds (UNREACHABLE, BUSY: connection refused or reset, timeouts, HTTP 5xx, throttling) are
the ones ``retry.call`` retries; the others (credentials refused, 401/403, a missing bucket, an
endpoint that is not an S3 endpoint, an unknown host) fail on the first attempt.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from puma.storage.credentials import CREDENTIAL_SOURCES, credentials_source
from puma.storage.settings import describe_endpoint, in_force, s3_endpoint
from puma.storage.uris import bucket_of, is_s3

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


def failure_message(what: str, uri: str, failure: Failure, attempts: int, seconds: float) -> str:
    """One line: what failed, where, why, and what to do."""
    if not is_s3(uri):
        return f"{what} {uri} failed: {failure.reason}"
    source = credentials_source() if failure.kind == DENIED else ""
    fields = {"where": f"endpoint {describe_endpoint()}", "reason": failure.reason, "bucket": bucket_of(uri),
              "tries": f"{attempts} attempt{'s' if attempts > 1 else ''} in {seconds:.1f} s",
              "bound": f"storage.retry.max_elapsed_s={in_force.retry.max_elapsed_s:g} bounds the wait",
              "source": CREDENTIAL_SOURCES.get(source, source or "nowhere"), "flag": _endpoint_flag()}
    return f"{what} {uri} failed: " + _ADVICE[failure.kind].format(**fields)


def _endpoint_flag() -> str:
    return f" --endpoint-url {s3_endpoint()}" if s3_endpoint() else ""
