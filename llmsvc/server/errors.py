"""Status codes with rich details (google.rpc) for every failure the server reports.

`ServiceError` is what handlers raise; `to_service_error` maps engine exceptions to it;
`abort(context, err)` ends the RPC with `grpc-status-details-bin` filled (BadRequest,
ErrorInfo{domain "llmsvc"}, RetryInfo). Messages never carry stack traces.
"""
from __future__ import annotations

import logging
from typing import Callable

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from llmsvc.engine.async_engine import EngineDeadError, EngineStepError, EngineStoppedError, OutputBacklogError
from llmsvc.engine.errors import is_worker_failure
from llmsvc.core.errors import (DuplicateRequestError, InvalidRequestError, LoRAAdminError, LoRANotFoundError,
                                PromptTooLongError, QueueFullError)
from llmsvc.sampling_params import PROTO_PARENTS, SamplingParamsError
from llmsvc.server.constraint_fields import PROTO_FIELDS
from llmsvc.structured.errors import ConstraintError

logger = logging.getLogger(__name__)
DOMAIN = "llmsvc"


class ServiceError(Exception):
    """A failure with its status code and the details a client can act on."""

    def __init__(self, code: grpc.StatusCode, message: str, *, reason: str = "",
                 field: str | None = None, metadata: dict[str, str] | None = None,
                 retry_delay_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.field = field
        self.metadata = dict(metadata or {})
        self.retry_delay_s = retry_delay_s

    def to_status(self, request_id: str | None = None) -> grpc.Status:
        # Messages may quote what the client sent (an unknown adapter name, a bad role): clipped,
        # so that the status and its details stay well inside the 8 KiB of trailers a gRPC
        # client accepts; past that it would see RESOURCE_EXHAUSTED instead of this status.
        message = clip(self.message, MAX_MESSAGE_CHARS)
        details: list = []
        if self.field is not None:
            # the description says what is wrong with the field, without naming it again (the
            # status message does: "sampling.top_p: must be in (0, 1], got 0")
            description = message.removeprefix(f"{self.field}: ")
            details.append(error_details_pb2.BadRequest(field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=self.field, description=description)]))
        if self.reason or self.code == grpc.StatusCode.INTERNAL:
            md = {k: clip(v, MAX_METADATA_CHARS) for k, v in self.metadata.items()}
            if request_id:
                md["request_id"] = request_id
            details.append(error_details_pb2.ErrorInfo(reason=self.reason or "INTERNAL", domain=DOMAIN, metadata=md))
        if self.retry_delay_s is not None:
            secs = int(self.retry_delay_s)
            details.append(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(
                seconds=secs, nanos=int((self.retry_delay_s - secs) * 1e9))))
        packed = []
        for d in details:
            a = any_pb2.Any()
            a.Pack(d)
            packed.append(a)
        status = rpc_status.to_status(status_pb2.Status(code=self.code.value[0], message=message, details=packed))
        if self.retry_delay_s is None:
            return status
        # the same delay where gRPC's own retry policy reads it (gRFC A6 server pushback)
        pushback = (("grpc-retry-pushback-ms", str(round(self.retry_delay_s * 1000))),)
        return status._replace(trailing_metadata=(*status.trailing_metadata, *pushback))


MAX_MESSAGE_CHARS = 1024
MAX_METADATA_CHARS = 256


def clip(text: str, limit: int) -> str:
    """text, or its first limit - 3 characters and "..." when longer (what a reply quotes of a request)."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def invalid(field: str, message: str, reason: str = "INVALID_ARGUMENT", **metadata) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}", reason=reason, field=field,
                        metadata={k: str(v) for k, v in metadata.items()})


def prompt_too_long(prompt_tokens: int, limit: int, message: str, field: str = "prompt") -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message, reason="PROMPT_TOO_LONG", field=field,
                        metadata={"prompt_tokens": str(prompt_tokens), "max_model_len": str(limit)})


def unavailable(message: str, reason: str = "UNAVAILABLE", retry_delay_s: float = 1.0) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message, reason=reason, retry_delay_s=retry_delay_s)


_RENAMED = {"prompt_token_ids": "token_ids.ids"}


def proto_field(name: str) -> str:
    """The GenerateRequest field path of an engine field name: 'stop[1]' -> 'stopping.stop[1]'."""
    base, bracket, index = name.partition("[")
    if base in _RENAMED:
        return _RENAMED[base] + bracket + index
    parent = PROTO_PARENTS.get(base)
    return f"{parent}.{name}" if parent else name


_LORA_CODES = {"LORA_EXISTS": grpc.StatusCode.ALREADY_EXISTS, "LORA_SLOTS_FULL": grpc.StatusCode.RESOURCE_EXHAUSTED,
               "LORA_LOAD_FAILED": grpc.StatusCode.INVALID_ARGUMENT}


def to_service_error(exc: BaseException, field_path: Callable[[str], str] = proto_field) -> ServiceError:
    """Map an exception from validation, the engine or AsyncEngine to its status. `field_path`
    names an engine field in the calling door's proto (llmsvc.v1's by default)."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, ConstraintError):  # did not compile: the proto field of its kind
        return invalid(f"sampling.{PROTO_FIELDS[exc.kind]}", exc.message, exc.reason)
    if isinstance(exc, PromptTooLongError):
        return prompt_too_long(exc.prompt_tokens, exc.max_model_len, exc.message)
    if isinstance(exc, LoRAAdminError):
        code = _LORA_CODES.get(exc.reason, grpc.StatusCode.FAILED_PRECONDITION)
        return ServiceError(code, exc.message, reason=exc.reason,
                            field="lora_path" if exc.reason == "LORA_LOAD_FAILED" else None)
    if isinstance(exc, LoRANotFoundError):
        return ServiceError(grpc.StatusCode.NOT_FOUND, exc.message, reason="LORA_NOT_FOUND", field="lora_name",
                            metadata={"lora_name": exc.name})
    if isinstance(exc, InvalidRequestError):
        return invalid(field_path(exc.field), exc.message)
    if isinstance(exc, DuplicateRequestError):
        return ServiceError(grpc.StatusCode.ALREADY_EXISTS, str(exc), reason="DUPLICATE_REQUEST_ID")
    if isinstance(exc, QueueFullError):
        return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"server busy: {exc}".rstrip(": "),
                            reason="QUEUE_FULL", retry_delay_s=1.0)
    if isinstance(exc, OutputBacklogError):
        return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), reason="OUTPUT_BACKLOG")
    if isinstance(exc, EngineStepError):  # the request was in the failing step: mid-stream failure
        return ServiceError(grpc.StatusCode.INTERNAL, "the engine failed while running this request "
                            "(the server stops serving and exits for a restart)", reason="ENGINE_ERROR")
    if isinstance(exc, EngineDeadError):
        return unavailable(f"engine is not running: {_first_line(exc)}", reason="ENGINE_DEAD")
    if isinstance(exc, EngineStoppedError):
        return unavailable("server is shutting down", reason="DRAINING")
    if isinstance(exc, SamplingParamsError):  # SamplingParams.verify(), outside admission
        return invalid(field_path(exc.field), exc.why)
    if isinstance(exc, ValueError):
        return invalid("request", str(exc))
    if is_worker_failure(exc):
        return unavailable(f"engine is not running: {_first_line(exc)}", reason="ENGINE_DEAD")
    return ServiceError(grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__})", reason="INTERNAL")


_MAX_CAUSE_CHARS = 300


def _first_line(exc: BaseException) -> str:
    """What a client is told of why the engine died: the first line of the cause, bounded. A
    worker's failure text carries its traceback (the server log has it whole); sent as is, it
    would reach clients and could pass the 8 KiB of trailers a gRPC client accepts, which then
    reports RESOURCE_EXHAUSTED instead of this status."""
    return clip(str(exc).strip().split("\n", 1)[0], _MAX_CAUSE_CHARS)


async def abort(context: grpc.aio.ServicerContext, exc: BaseException, request_id: str | None = None,
                field_path: Callable[[str], str] = proto_field):
    """End the RPC with the mapped status (raises grpc's AbortError, as context.abort does)."""
    err = to_service_error(exc, field_path)
    if err.code == grpc.StatusCode.INTERNAL and not isinstance(exc, ServiceError):
        logger.error("request %s failed", request_id, exc_info=exc)
    await context.abort_with_status(err.to_status(request_id))
