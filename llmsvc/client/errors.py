"""Typed exceptions for llmsvc RPC failures, decoded from the status code and google.rpc details.

`from_rpc_error(err)` turns any `grpc.RpcError` (sync or grpc.aio) into the matching subclass of
`LlmsvcError`. The rich details the server sends in `grpc-status-details-bin` (docs/api.md's error
table) are decoded: `BadRequest.field_violations`, `ErrorInfo{reason, domain, metadata}` and
`RetryInfo.retry_delay` are exposed as attributes; every decoded detail message is in `.details`.
"""
from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

_DETAILS_KEY = "grpc-status-details-bin"

# google.rpc detail messages we can unpack from google.protobuf.Any
_DETAIL_TYPES = (
    error_details_pb2.ErrorInfo,
    error_details_pb2.RetryInfo,
    error_details_pb2.BadRequest,
    error_details_pb2.DebugInfo,
    error_details_pb2.QuotaFailure,
    error_details_pb2.PreconditionFailure,
    error_details_pb2.ResourceInfo,
    error_details_pb2.RequestInfo,
    error_details_pb2.Help,
    error_details_pb2.LocalizedMessage,
)


class LlmsvcError(Exception):
    """An RPC to llmsvc failed.

    code: the grpc.StatusCode; message: the status message (for people);
    details: decoded google.rpc detail messages (ErrorInfo, BadRequest, RetryInfo, ...; an
    undecodable one stays a google.protobuf.Any).
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None,
                 details: list[Any] | None = None, request_id: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.details = list(details or [])
        self.request_id = request_id

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    def _first(self, cls):
        return next((d for d in self.details if isinstance(d, cls)), None)

    @property
    def error_info(self) -> error_details_pb2.ErrorInfo | None:
        return self._first(error_details_pb2.ErrorInfo)

    @property
    def reason(self) -> str | None:
        """ErrorInfo.reason (e.g. "PROMPT_TOO_LONG"), if sent."""
        info = self.error_info
        return info.reason if info is not None else None

    @property
    def domain(self) -> str | None:
        info = self.error_info
        return info.domain if info is not None else None

    @property
    def metadata(self) -> dict[str, str]:
        """ErrorInfo.metadata ({} when absent)."""
        info = self.error_info
        return dict(info.metadata) if info is not None else {}

    @property
    def field_violations(self) -> list[tuple[str, str]]:
        """BadRequest.field_violations as (field, description) pairs."""
        bad = self._first(error_details_pb2.BadRequest)
        return [(v.field, v.description) for v in bad.field_violations] if bad is not None else []

    @property
    def retry_delay(self) -> float | None:
        """RetryInfo.retry_delay in seconds, if the server suggested one."""
        info = self._first(error_details_pb2.RetryInfo)
        return info.retry_delay.ToTimedelta().total_seconds() if info is not None else None


class InvalidArgument(LlmsvcError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class PromptTooLong(InvalidArgument):
    """INVALID_ARGUMENT with ErrorInfo.reason PROMPT_TOO_LONG."""

    @property
    def prompt_tokens(self) -> int | None:
        value = self.metadata.get("prompt_tokens")
        return int(value) if value is not None else None

    @property
    def max_model_len(self) -> int | None:
        value = self.metadata.get("max_model_len")
        return int(value) if value is not None else None


class FailedPrecondition(LlmsvcError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ClientClosed(FailedPrecondition):
    """A call on a Client / AsyncClient after close() (or its with block): nothing was sent."""


class NotFound(LlmsvcError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(LlmsvcError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(LlmsvcError):
    """Waiting queue full (retry after .retry_delay) or the client read too slowly."""
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(LlmsvcError):
    """Loading, draining, shutting down or unreachable; retry (elsewhere) after .retry_delay."""
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(LlmsvcError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(LlmsvcError):
    code = grpc.StatusCode.CANCELLED


class Unauthenticated(LlmsvcError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(LlmsvcError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unimplemented(LlmsvcError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(LlmsvcError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[LlmsvcError]] = {
    cls.code: cls for cls in (
        InvalidArgument, FailedPrecondition, NotFound, AlreadyExists, ResourceExhausted,
        Unavailable, DeadlineExceeded, Cancelled, Unauthenticated, PermissionDenied,
        Unimplemented, Internal,
    )
}


def _unpack(detail: any_pb2.Any) -> Any:
    for cls in _DETAIL_TYPES:
        if detail.Is(cls.DESCRIPTOR):
            msg = cls()
            detail.Unpack(msg)
            return msg
    return detail


def _rich_status(err: grpc.RpcError) -> status_pb2.Status | None:
    try:
        return rpc_status.from_call(err)
    except ValueError:  # code/message in the details disagree with the status: trust the details
        for key, value in err.trailing_metadata() or ():
            if key == _DETAILS_KEY:
                return status_pb2.Status.FromString(value)
    except Exception:  # not a call object (e.g. a bare RpcError): no details
        return None
    return None


def error_class(code: grpc.StatusCode, reason: str | None = None) -> type[LlmsvcError]:
    """The exception class for a status code (and ErrorInfo.reason)."""
    if code == grpc.StatusCode.INVALID_ARGUMENT and reason == "PROMPT_TOO_LONG":
        return PromptTooLong
    return _BY_CODE.get(code, LlmsvcError)


def from_rpc_error(err: grpc.RpcError, request_id: str | None = None) -> LlmsvcError:
    """The typed exception for a failed call (sync or grpc.aio)."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    message = (err.details() if callable(getattr(err, "details", None)) else None) or ""
    rich = _rich_status(err)
    details = [_unpack(d) for d in rich.details] if rich is not None else []
    if rich is not None and not message:
        message = rich.message
    reason = next((d.reason for d in details if isinstance(d, error_details_pb2.ErrorInfo)), None)
    cls = error_class(code, reason)
    exc = cls(message, code=code, details=details, request_id=request_id)
    if exc.request_id is None:
        exc.request_id = exc.metadata.get("request_id") or None
    return exc
