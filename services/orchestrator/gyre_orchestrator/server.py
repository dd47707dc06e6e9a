"""gRPC `gyre.v1.Orchestrator` (NotifyWeights, GetStatus) plus `grpc.health.v1` and reflection.

Runs on the orchestrator's event loop (grpc.aio), so handlers touch the relay and the service state
without locks. Health is NOT_SERVING until the service says it is ready (replicas known, weights
relayed, resume done). With `server.control_token` set, Orchestrator calls must carry
`authorization: Bearer <token>` (else UNAUTHENTICATED); health and reflection stay open because
Kubernetes `grpc:` probes cannot send metadata and neither exposes anything but the schema.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
from gyre.grpc_server import AioGrpcServer
from gyre.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from gyre.weights import WeightsError, WeightsVersion

from gyre_orchestrator.relay import WeightRelay

log = logging.getLogger(__name__)

SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name


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


class OrchestratorServer(AioGrpcServer):
    """`await start()` binds (port 0 = free port) and returns the port; `await stop()` (`gyre.grpc_server`)."""

    def __init__(
        self,
        relay: WeightRelay,
        last_step: Callable[[], int],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        control_token: str | None = None,
    ):
        super().__init__(SERVICE_NAME, token=control_token, what="the orchestrator gRPC server")
        self.host = host
        self.requested_port = port
        orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(_OrchestratorServicer(relay, last_step), self.server)

    async def start(self) -> int:
        port = await super().start(self.host, self.requested_port)
        log.info("gRPC gyre.v1.Orchestrator + health on %s:%d", self.host, port)
        return port

    async def stop(self, grace: float = 2.0) -> None:
        await super().stop(grace)
