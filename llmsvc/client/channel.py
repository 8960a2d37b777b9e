"""Channel settings shared by the sync and async clients: options, TLS credentials, call metadata.

Keepalive is compatible with the server's policy (docs/api.md): the server accepts pings every
>= 10 s without data and never counts strikes, so the client pings every 30 s, also between
calls and during a long silent prefill.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

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

Credentials = grpc.ChannelCredentials | bytes | str | bool | None


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
