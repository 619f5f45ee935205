"""The two ways the search service says no: a request it refuses (an HTTP status and a one-line
reason) and a service that cannot start (a config, index or checkpoint that cannot work)."""

from __future__ import annotations

from puma.errors import UserError


class RequestError(UserError):
    """A request the service refuses: ``status`` (4xx, or 503 while the index is empty) and a one-line
    reason that names what was wrong and what is valid."""

    def __init__(self, status: int, reason: str, cause: str = "") -> None:
        self.status = int(status)
        self.reason = " ".join(str(reason).split()) or f"HTTP {status}"
        self.cause = cause  # a 503's cause for ray_puma_refused_total (puma/serve/metrics.py)
        super().__init__(self.reason)

    def __reduce__(self):
        return RequestError, (self.status, self.reason, self.cause)  # crosses process boundaries (Ray) intact

    def to_dict(self) -> dict:
        """The JSON body of the error response."""
        return {"error": self.reason, "status": self.status}


class ServiceSetupError(UserError):
    """The service cannot start as configured (checked on the driver, before any replica starts)."""


def as_request_error(exc: BaseException) -> RequestError | None:
    """The RequestError inside ``exc`` (Ray wraps errors raised in another replica), or None."""
    for candidate in (getattr(exc, "cause", None), exc, exc.__cause__):
        if isinstance(candidate, RequestError) and hasattr(candidate, "status"):
            return RequestError(candidate.status, candidate.reason)
    return None
