"""Bearer-token check for the collector's gRPC services.

Clients send ``authorization: Bearer <token>`` metadata. A missing or wrong token ends the call with
UNAUTHENTICATED before any handler runs. The standard health service stays open so that load
balancers and systemd checks work without the secret; it reveals nothing but "serving".
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"


class TokenError(ValueError):
    """The token option is unusable (empty file, unreadable, ...)."""


def load_token(token: str | None = None, token_file: str | None = None) -> str | None:
    """The token from ``token`` or the first line of ``token_file`` (one of them at most)."""
    if token and token_file:
        raise TokenError("give either --token or --token-file, not both")
    if token_file:
        try:
            text = Path(token_file).read_text().strip()
        except OSError as exc:
            raise TokenError(f"cannot read the token file {token_file}: {exc.strerror}") from None
        if not text:
            raise TokenError(f"the token file {token_file} is empty")
        return text.splitlines()[0].strip()
    if token is not None and not token.strip():
        raise TokenError("the token is empty")
    return token.strip() if token else None


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` (empty when there is none)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def _abort_handler(template: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def abort(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def abort_stream(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator for streaming responses

    if template.request_streaming and template.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort_stream)
    if template.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if template.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort_stream)
    return grpc.unary_unary_rpc_method_handler(abort)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call (except health checks) that lacks ``authorization: Bearer <token>``."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        got = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
                break
        if got is None:
            return _abort_handler(handler, "this collector requires a token: send "
                                           "'authorization: Bearer <token>' metadata (--token)")
        if not hmac.compare_digest(got, self._expected):
            return _abort_handler(handler, "the token does not match this collector's token")
        return handler
