"""HTTP at the ingress's door: the request body cut at its limit, query parameters, the bearer token,
and every refusal as a one-line JSON error with its status (401 with WWW-Authenticate, 503 with
Retry-After). What a request may hold is puma.serve.requests (no web framework there).
"""

# No `from __future__ import annotations`: like the routes (puma.serve.ingress), these take
# FastAPI's Request at run time.
import hmac
import math

from fastapi import Request
from fastapi.responses import JSONResponse

from puma.serve.errors import RequestError, as_request_error
from puma.serve.requests import media_type


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit`` bytes (declared or sent)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"request body is {declared} bytes; the limit is {limit} "
                                "(serve.max_upload_bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"request body is over the limit of {limit} bytes "
                                    "(serve.max_upload_bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def body_limit(content_type: str, max_upload_bytes: int) -> int:
    """Bytes a body may have: the image limit, plus base64 and form overhead for JSON and forms."""
    if media_type(content_type) in ("application/json", "multipart/form-data"):
        return max_upload_bytes * 4 // 3 + 64 * 1024
    return max_upload_bytes


def params(request: Request) -> dict[str, list[str]]:
    """The query string's parameters, each with every value it was given."""
    query = request.query_params
    return {name: query.getlist(name) for name in query}


def authorise(request: Request, token: str, token_env: str) -> None:
    """401 unless the request carries ``Authorization: Bearer <token>`` (when a token is set)."""
    if not token:
        return
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token.encode()):
        raise RequestError(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>' "
                                f"with the service's token (${token_env} where it runs)")


def unavailable(exc: BaseException) -> RequestError | None:
    """503 for a deployment that cannot answer now (a replica died or restarts, a node was lost, its
    queue is full): the client retries after Retry-After; None for other failures."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    kinds = (ActorDiedError, ActorUnavailableError, RayActorError, BackPressureError,
             DeploymentUnavailableError)
    for candidate in (exc, getattr(exc, "cause", None), exc.__cause__):
        if isinstance(candidate, kinds):
            cause = "backpressure" if isinstance(candidate, BackPressureError) else "replica_unavailable"
            return RequestError(503, "a replica this request needs is unavailable "
                                     f"({type(candidate).__name__}: restarting, or its node was lost); "
                                     "retry after the Retry-After seconds", cause)
    return None


def refusal(exc: BaseException) -> RequestError | None:
    """The refusal a failure answers with: its RequestError (raised here or in a deployment), or 503
    for a deployment that cannot answer now; None for an internal error."""
    return as_request_error(exc) or unavailable(exc)


def internal_error(exc: BaseException) -> RequestError:
    """500 for a failure that is no refusal (the replica's log has the traceback)."""
    return RequestError(500, f"internal error: {type(exc).__name__}; see the replica's log")


def error_response(error: RequestError, retry_after_s: float) -> JSONResponse:
    """``{"error": "<one line>", "status": N}`` with that status: 401 asks for the bearer token, 503
    says when to retry."""
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    if error.status == 503:
        headers = {"Retry-After": f"{math.ceil(retry_after_s)}"}
    return JSONResponse(error.to_dict(), status_code=error.status, headers=headers)
