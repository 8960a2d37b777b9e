"""Channel settings shared by the sync and async clients: options, TLS credentials, call metadata.

Keepalive is compatible with the server's policy (docs/api.md): the server accepts pings every
>= 10 s without data and never counts strikes, so the client pings every 30 s, also between
calls and during a long silent prefill.
"""
from __future__ import annotations

import json
import random
import os
from collections.abc import Sequence
from typing import Any

import grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # matches the server's receive limit (long token-id prompts)
KEEPALIVE_TIME_MS = 30_000            # >= the server's min_ping_interval_without_data (10 s)
KEEPALIVE_TIMEOUT_MS = 10_000

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),  # a long prefill sends no data for a while
)

MAX_RETRIES = 4  # gRPC caps a retry policy at 5 attempts
RETRYABLE_CODES = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")

Credentials = grpc.ChannelCredentials | bytes | str | bool | None


def retry_service_config(max_retries: int, streams: bool = True) -> str:
    """gRPC's service config (JSON) retrying every LlmService call up to `max_retries` times on
    UNAVAILABLE and RESOURCE_EXHAUSTED (gRFC A6). gRPC retries only until response headers
    arrive, and the server sends a Generate's headers once the engine took the request, so a
    refused call is retried and a started stream never is. The wait before an attempt is the
    server's pushback (its RetryInfo delay, sent again as grpc-retry-pushback-ms), else an
    exponential backoff from 0.5 s (randomised by gRPC, at most 5 s). streams=False leaves
    Generate out (the sync client retries it itself: grpcio's blocking API can hang for good,
    past the call's deadline, retrying a server-streaming call to a server that went away)."""
    if not 0 <= max_retries <= MAX_RETRIES:
        raise ValueError(f"max_retries must be in [0, {MAX_RETRIES}], got {max_retries}")
    policy = {"maxAttempts": max_retries + 1, "initialBackoff": "0.5s", "maxBackoff": "5s",
              "backoffMultiplier": 2, "retryableStatusCodes": list(RETRYABLE_CODES)}
    configs = [{"name": [{"service": "llmsvc.v1.LlmService"}], "retryPolicy": policy}]
    if not streams:  # the most specific name wins: Generate gets no policy
        configs.append({"name": [{"service": "llmsvc.v1.LlmService", "method": "Generate"}]})
    return json.dumps({"methodConfig": configs})


def retry_delay(err: grpc.RpcError, attempt: int) -> float:
    """Seconds before retry `attempt` (1, 2, ...) of a refused call, as gRPC's policy waits:
    the server's pushback, else a randomised exponential backoff from 0.5 s, at most 5 s."""
    for key, value in err.trailing_metadata() or ():
        if key == "grpc-retry-pushback-ms":
            try:
                return max(0.0, int(value) / 1000)
            except ValueError:
                break
    return random.uniform(0, min(5.0, 0.5 * 2 ** (attempt - 1)))


def channel_options(max_retries: int = 0, extra: Sequence[tuple[str, Any]] = (),
                    retry_streams: bool = True) -> tuple[tuple[str, Any], ...]:
    """The client's channel options: CHANNEL_OPTIONS, the retry policy when max_retries > 0,
    then the caller's own (which win, being last)."""
    config = retry_service_config(max_retries, retry_streams)  # raises on a bad count, also for 0
    retry = (("grpc.enable_retries", 1), ("grpc.service_config", config)) if max_retries else ()
    return (*CHANNEL_OPTIONS, *retry, *extra)


def channel_credentials(credentials: Credentials) -> grpc.ChannelCredentials | None:
    """None/False: plaintext. True: TLS with the system roots. bytes: PEM root certificates.
    str: path of a PEM root-certificate file. A grpc.ChannelCredentials is used as is (mTLS)."""
    if credentials is None or credentials is False:
        return None
    if credentials is True:
        return grpc.ssl_channel_credentials()
    if isinstance(credentials, grpc.ChannelCredentials):
        return credentials
    if isinstance(credentials, str):
        with open(os.path.expanduser(credentials), "rb") as f:
            credentials = f.read()
    return grpc.ssl_channel_credentials(root_certificates=credentials)


def compression_of(compression: grpc.Compression | str | None) -> grpc.Compression | None:
    """"gzip" / "deflate" / "none" or a grpc.Compression."""
    if compression is None or isinstance(compression, grpc.Compression):
        return compression
    names = {"gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate,
             "none": grpc.Compression.NoCompression}
    try:
        return names[compression.lower()]
    except KeyError:
        raise ValueError(f"compression must be one of {sorted(names)}, got {compression!r}") from None


def call_metadata(token: str | None, extra: Sequence[tuple[str, str]] | None = None,
                  request_id: str | None = None) -> tuple[tuple[str, str], ...]:
    """Per-call metadata: bearer token, x-request-id, then any caller-supplied pairs."""
    md: list[tuple[str, str]] = []
    if token:
        md.append(("authorization", f"Bearer {token}"))
    if request_id:
        md.append(("x-request-id", request_id))
    md.extend(extra or ())
    return tuple(md)


def request_id_from_metadata(metadata) -> str | None:
    """The x-request-id value in (initial) response metadata, if present."""
    for key, value in metadata or ():
        if key == "x-request-id":
            return value.decode() if isinstance(value, bytes) else value
    return None
