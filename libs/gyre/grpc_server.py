"""The gRPC server scaffold of the three services: their API + `grpc.health.v1` + reflection + token auth.

- Health starts NOT_SERVING (for `""` and the service's name) and says SERVING only once the service
  calls `set_serving(True)`; Kubernetes' native `grpc:` probes read it.
- With a token, every call except health and reflection must carry metadata
  `authorization: Bearer <token>` (else UNAUTHENTICATED). The token is a string, or an object whose
  `accepts(authorization)` decides (the inference server's, which takes up a rotated token file). Health
  and reflection stay open: Kubernetes probes cannot send metadata, and reflection only describes the API.
- `start(host, port)` binds (port 0 = a free one; IPv6 hosts are bracketed) and returns the port, or
  raises OSError naming the address.

`AioGrpcServer` runs on an asyncio loop (inference, orchestrator); `ThreadedGrpcServer` on a thread pool
(the trainer, whose loop is not asyncio). Add the servicer to `.server` before `start()`.
"""

from __future__ import annotations

import hmac
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

OPEN_PREFIXES = (f"/{health.SERVICE_NAME}/", "/grpc.reflection.")
DENIED = "missing or wrong control token (metadata authorization: Bearer <token>)"


class _FixedToken:
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def accepts(self, authorization: str) -> bool:
        return hmac.compare_digest(authorization.encode(), self._expected)


def _checker(token):
    """A token's checker: a string compared as it is, or an object with its own `accepts(authorization)`."""
    return _FixedToken(token) if isinstance(token, str) else token


def _authorized(details, token) -> bool:
    if details.method.startswith(OPEN_PREFIXES):
        return True
    sent = dict(details.invocation_metadata or ()).get("authorization", "")
    return token.accepts(sent.decode("latin-1") if isinstance(sent, bytes) else sent)


class _AioTokenAuth(grpc.aio.ServerInterceptor):
    def __init__(self, token):
        self._token = _checker(token)

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        return await continuation(details) if _authorized(details, self._token) else self._deny


class _TokenAuth(grpc.ServerInterceptor):
    def __init__(self, token):
        self._token = _checker(token)

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, details):
        return continuation(details) if _authorized(details, self._token) else self._deny


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bind(server, host: str, port: int, what: str) -> int:
    address = _address(host, port)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as error:  # grpc raises this for an address in use
        raise OSError(f"cannot bind {what} to {address}: {error}") from None
    if not bound:
        raise OSError(f"cannot bind {what} to {address}")
    return bound


def _statuses(serving: bool):
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


class AioGrpcServer:
    """A grpc.aio server with health, reflection and optional token auth; `await start()`, `await stop()`."""

    def __init__(self, service_name: str, *, token=None, what: str = "the gRPC server"):
        self.service_name = service_name
        self.what = what
        self.port: int | None = None
        self.server = grpc.aio.server(interceptors=[_AioTokenAuth(token)] if token else [])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)

    async def start(self, host: str, port: int) -> int:
        """Bind and start with health NOT_SERVING; returns the bound port."""
        self.port = _bind(self.server, host, port, self.what)
        await self.set_serving(False)
        await self.server.start()
        return self.port

    async def set_serving(self, serving: bool) -> None:
        for name in ("", self.service_name):
            await self.health.set(name, _statuses(serving))

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


class ThreadedGrpcServer:
    """The same on a thread pool (for processes without an asyncio loop); `start()`, `stop()`."""

    def __init__(
        self, service_name: str, *, token: str | None = None, what: str = "the gRPC server", max_workers: int = 4
    ):
        self.service_name = service_name
        self.what = what
        self.port: int | None = None
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
            interceptors=[_TokenAuth(token)] if token else [],
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        self.set_serving(False)

    def start(self, host: str, port: int) -> int:
        self.port = _bind(self.server, host, port, self.what)
        self.server.start()
        return self.port

    def set_serving(self, serving: bool) -> None:
        for name in ("", self.service_name):
            self.health.set(name, _statuses(serving))

    def stop(self, grace: float) -> None:
        self.set_serving(False)
        self.server.stop(grace).wait()
