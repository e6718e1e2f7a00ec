"""Errors that cross a boundary: each carries its HTTP status, gRPC status and a stable code.

Every error body on the HTTP API is ``{"error": {"code": ..., "message": ...}}``; the gRPC
API sends the same code in the ``lifl-error-code`` trailer and the message as grpc-message.
"""

from __future__ import annotations

from typing import Any


class LiflError(Exception):
    """Base error; subclasses fix the HTTP/gRPC status, callers pick a precise ``code``."""

    status = 400
    grpc_status = "INVALID_ARGUMENT"
    default_code = "bad_request"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        retry_after: float | None = None,
        extra: dict[str, Any] | None = None,
        grpc_status: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.retry_after = retry_after
        self.extra = extra or {}
        if grpc_status is not None:
            self.grpc_status = grpc_status

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        error.update(self.extra)
        return {"error": error}


class BadRequest(LiflError):
    """Malformed input: bad syntax, truncated or inconsistent bytes (HTTP 400)."""


class Unauthenticated(LiflError):
    """No credentials, or credentials that identify nobody: unknown, expired or revoked (HTTP 401)."""

    status = 401
    grpc_status = "UNAUTHENTICATED"
    default_code = "unauthenticated"


class Forbidden(LiflError):
    """The caller is known, and its role may not do this in its scope (HTTP 403). Outside its
    scope a resource does not exist for it (404), so names do not leak."""

    status = 403
    grpc_status = "PERMISSION_DENIED"
    default_code = "forbidden"


class QuotaExceeded(Forbidden):
    """A tenant's quota (``lifl.quotas``) forbids this until the tenant frees some or the
    operator raises it (HTTP 403); ``extra`` names the quota, its limit and the use."""

    default_code = "quota_exceeded"


class NotFound(LiflError):
    status = 404
    grpc_status = "NOT_FOUND"
    default_code = "not_found"


class Conflict(LiflError):
    """The request is well formed but conflicts with current state (HTTP 409)."""

    status = 409
    grpc_status = "ABORTED"
    default_code = "conflict"


class PreconditionFailed(LiflError):
    """A precondition the protocol puts on a request does not hold (HTTP 412): a resumable
    upload's request that does not speak the tus version the gateway does."""

    status = 412
    grpc_status = "FAILED_PRECONDITION"
    default_code = "precondition_failed"


class UnsupportedMediaType(LiflError):
    """The body's Content-Type is not the one the endpoint takes (HTTP 415)."""

    status = 415
    default_code = "unsupported_media_type"


class RangeNotSatisfiable(LiflError):
    """A download's Range starts past the end of what it asks for (HTTP 416); ``extra["size"]``
    is the whole length, which the answer's ``Content-Range: bytes */size`` says too."""

    status = 416
    grpc_status = "OUT_OF_RANGE"
    default_code = "range_not_satisfiable"


class PayloadTooLarge(LiflError):
    status = 413
    grpc_status = "INVALID_ARGUMENT"
    default_code = "payload_too_large"


class Unprocessable(LiflError):
    """Well-formed bytes whose content is not acceptable: wrong tensors, NaN/Inf (HTTP 422)."""

    status = 422
    grpc_status = "INVALID_ARGUMENT"
    default_code = "invalid_update"


class RetryLater(LiflError):
    """The request did nothing and may be sent again after ``retry_after`` seconds (HTTP 503)."""

    status = 503

    def __init__(self, message: str, *, retry_after: float = 1.0, code: str | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        super().__init__(message, code=code, retry_after=retry_after, extra=extra)


class Overloaded(RetryLater):
    """Back-pressure: shared memory or an in-flight budget is exhausted."""

    grpc_status = "RESOURCE_EXHAUSTED"
    default_code = "overloaded"


class QuotaBusy(Overloaded):
    """A tenant's quota of what ends by itself (rounds in progress, shared memory in use) is
    reached: retry after ``retry_after`` seconds (HTTP 429)."""

    status = 429
    default_code = "quota_exceeded"


class Unavailable(RetryLater):
    """A dependency (Redis, the node's agent, a peer node, the checkpoint store) cannot be
    reached or written right now."""

    grpc_status = "UNAVAILABLE"
    default_code = "unavailable"


class Internal(LiflError):
    status = 500
    grpc_status = "INTERNAL"
    default_code = "internal"
