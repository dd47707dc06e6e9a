"""gRPC `gyre.v1.Orchestrator` (NotifyWeights, GetStatus) plus `grpc.health.v1` and reflection.

Runs on the orchestrator's event loop (grpc.aio), so handlers touch the relay and the service state
without locks. Health is NOT_SERVING until the service says it is ready (replicas known, weights
relayed, resume done). With `server.control_token` set, Orchestrator calls must carry
`authorization: Bearer <token>` (else UNAUTHENTICATED); health and reflection stay open because
Kubernetes `grpc:` probes cannot send metadata and neither exposes anything but the schema.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from gyre.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from gyre.weights import WeightsError, WeightsVersion

from gyre_orchestrator.relay import WeightRelay

log = logging.getLogger(__name__)

SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name
_OPEN_PREFIXES = (f"/{health.SERVICE_NAME}/", f"/{reflection.SERVICE_NAME}/", "/grpc.reflection.v1.")


class _TokenAuth(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        if details.method.startswith(_OPEN_PREFIXES):
            return await continuation(details)
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        sent = sent.encode() if isinstance(sent, str) else sent
        if hmac.compare_digest(sent, self._expected):
            return await continuation(details)

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong authorization bearer token")

        return grpc.unary_unary_rpc_method_handler(deny)


class _OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, relay: WeightRelay, last_step: Callable[[], int]):
        self.relay = relay
        self.last_step = last_step

    async def NotifyWeights(self, request, context):  # noqa: N802 (gRPC method name)
        try:
            accepted = self.relay.notify(WeightsVersion.from_proto(request.version))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except WeightsError as e:
            # not visible (yet) on our volume, or not the announced files: the trainer retries
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        log.info("NotifyWeights(step=%d): %s", request.version.step, "new version" if accepted else "already known")
        return orchestrator_pb2.NotifyWeightsResponse(accepted=True, latest_step=self.relay.latest_step)

    async def GetStatus(self, request, context):  # noqa: N802
        replicas = self.relay.replicas
        return orchestrator_pb2.GetOrchestratorStatusResponse(
            step=self.last_step(),
            latest_weights_step=self.relay.latest_step,
            replicas=[
                orchestrator_pb2.ReplicaStatus(
                    address=r.url, step=-1 if r.version is None else r.version, healthy=replicas.in_rotation(r)
                )
                for r in replicas
            ],
            in_use_steps=sorted(self.relay.transport.held()),
        )


class OrchestratorServer:
    """`await start()` binds (port 0 = free port) and returns the port; `await stop()`."""

    def __init__(
        self,
        relay: WeightRelay,
        last_step: Callable[[], int],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        control_token: str | None = None,
    ):
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        interceptors = [_TokenAuth(control_token)] if control_token else []
        self._server = grpc.aio.server(interceptors=interceptors)
        self._health = health.aio.HealthServicer()
        orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(_OrchestratorServicer(relay, last_step), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server)

    async def start(self) -> int:
        await self.set_serving(False)
        address = f"[{self.host}]:{self.requested_port}" if ":" in self.host else f"{self.host}:{self.requested_port}"
        port = self._server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot bind the orchestrator gRPC server to {address}")
        await self._server.start()
        self.port = port
        log.info("gRPC gyre.v1.Orchestrator + health on %s:%d", self.host, port)
        return port

    async def set_serving(self, serving: bool) -> None:
        state = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self._health.set(name, state)

    async def stop(self, grace: float = 2.0) -> None:
        await self.set_serving(False)
        await self._server.stop(grace)
