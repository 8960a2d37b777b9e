"""Optional bearer-token auth: a grpc.aio server interceptor over `authorization: Bearer <token>`.

Tokens come from `--auth-token-file` (one per line; blank lines and `#` comments ignored) and/or
LLMSVC_AUTH_TOKENS (comma-separated). No tokens configured = auth off. A call without the header
or with a token not in the set ends UNAUTHENTICATED (ErrorInfo reason "UNAUTHENTICATED",
trailer `www-authenticate: Bearer`); health and reflection stay open so probes need no secret.
Tokens are compared in constant time against every configured token.

Admin tokens (`--admin-token-file`, LLMSVC_ADMIN_TOKENS) guard llmsvc.v1.AdminService alone, in a
second interceptor of this class (`guarded_prefixes=ADMIN_PREFIXES`); the inference one leaves
that service to it, so an inference token never grants an admin call and an admin client needs
no inference token.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Iterable

import grpc

from llmsvc.server.errors import ServiceError
from llmsvc.server.rpc_wrap import deny_handler
from llmsvc.v1 import llmsvc_pb2

logger = logging.getLogger(__name__)

TOKENS_ENV = "LLMSVC_AUTH_TOKENS"
ADMIN_TOKENS_ENV = "LLMSVC_ADMIN_TOKENS"
ADMIN_PREFIXES = (f"/{llmsvc_pb2.DESCRIPTOR.services_by_name['AdminService'].full_name}/",)
# method-name prefixes any caller may use without a token
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


def load_tokens(token_file: str | None = None, env_value: str | None = None,
                flag: str = "--auth-token-file") -> list[str]:
    """Tokens from a file (one per line) plus a comma-separated string (normally $LLMSVC_AUTH_TOKENS).
    A file that cannot be read or holds no token is a ValueError naming `flag`."""
    tokens: list[str] = []
    if token_file:
        try:
            with open(os.path.expanduser(token_file), encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{flag}: cannot read {token_file!r}: {getattr(e, 'strerror', None) or e}") from None
        tokens = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not tokens:
            raise ValueError(f"{flag}: {token_file!r} holds no tokens")
    if env_value:
        tokens.extend(t.strip() for t in env_value.split(",") if t.strip())
    for t in tokens:
        if any(c.isspace() for c in t):
            raise ValueError("auth tokens must not contain whitespace")
    return list(dict.fromkeys(tokens))


def _digest(token: str) -> bytes:
    # equal-length digests: compare_digest's time then depends on neither token's length
    return hashlib.sha256(token.encode("utf-8")).digest()


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls that lack a valid `authorization: Bearer <token>`: calls to every method but
    the open ones, or, with `guarded_prefixes`, to those methods only."""

    def __init__(self, tokens: Iterable[str], open_prefixes: Iterable[str] = OPEN_PREFIXES + ADMIN_PREFIXES,
                 guarded_prefixes: Iterable[str] | None = None) -> None:
        self._digests = [_digest(t) for t in tokens]
        if not self._digests:
            raise ValueError("BearerTokenInterceptor needs at least one token")
        self.open_prefixes = tuple(open_prefixes)
        self.guarded_prefixes = None if guarded_prefixes is None else tuple(guarded_prefixes)

    def guards(self, method: str) -> bool:
        if self.guarded_prefixes is not None:
            return method.startswith(self.guarded_prefixes)
        return not method.startswith(self.open_prefixes)

    def is_valid(self, token: str) -> bool:
        d = _digest(token)
        ok = False
        for ref in self._digests:  # no early exit: time does not tell which token matched
            ok |= hmac.compare_digest(d, ref)
        return ok

    def check(self, metadata) -> str | None:
        """None when `metadata` carries a valid token, else why not."""
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if not values:
            return "missing authorization metadata (expected 'authorization: Bearer <token>')"
        value = values[0].decode("latin-1") if isinstance(values[0], bytes) else values[0]
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "authorization metadata must be 'Bearer <token>'"
        if not self.is_valid(token.strip()):
            return "invalid bearer token"
        return None

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not self.guards(handler_call_details.method):
            return handler
        why = self.check(handler_call_details.invocation_metadata)
        if why is None:
            return handler
        logger.info("rejected %s: %s", handler_call_details.method, why)
        status = ServiceError(grpc.StatusCode.UNAUTHENTICATED, why, reason="UNAUTHENTICATED").to_status()
        trailers = tuple(status.trailing_metadata or ()) + (("www-authenticate", "Bearer"),)

        async def deny(context: grpc.aio.ServicerContext) -> None:
            await context.abort(status.code, status.details, trailers)
        return deny_handler(handler, deny)
