"""gRPC `gyre.v1.Trainer` (GetStatus) plus `grpc.health.v1` and reflection, served by rank 0.

Health is NOT_SERVING until the trainer has loaded (and, when resuming, restored) its state and is
ready to take batches; Kubernetes probes use it natively (`grpc:` probes). GetStatus reads a
`TrainerStatus` that the training loop updates after each published step.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from gyre.v1 import trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name


@dataclass
class TrainerStatus:
    """What GetStatus reports; updated by the training loop under `lock`."""

    step: int = 0
    last_step_unix: float = 0.0
    tokens: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        self.lock = threading.Lock()

    def update(self, step: int, tokens: int) -> None:
        with self.lock:
            self.step = step
            self.tokens += tokens
            self.last_step_unix = time.time()


class _TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, status: TrainerStatus):
        self.status = status

    def GetStatus(self, request, context):  # noqa: N802 (gRPC method name)
        s = self.status
        with s.lock:
            return trainer_pb2.GetTrainerStatusResponse(
                step=s.step, last_step_unix=s.last_step_unix, tokens=s.tokens, world_size=s.world_size
            )


class TrainerServer:
    """The trainer's gRPC server; `start()` returns the bound port (port 0 = a free one)."""

    def __init__(self, status: TrainerStatus, host: str = "127.0.0.1", port: int = 0):
        self.status = status
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="trainer-grpc"))
        self._health = health.HealthServicer()
        trainer_pb2_grpc.add_TrainerServicer_to_server(_TrainerServicer(status), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server)
        self.set_serving(False)

    def start(self) -> int:
        address = f"[{self.host}]:{self.requested_port}" if ":" in self.host else f"{self.host}:{self.requested_port}"
        port = self._server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot bind the trainer gRPC server to {address}")
        self._server.start()
        self.port = port
        log.info("gRPC gyre.v1.Trainer + health on %s:%d", self.host, port)
        return port

    def set_serving(self, serving: bool) -> None:
        state = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            self._health.set(name, state)

    def stop(self, grace: float = 2.0) -> None:
        self.set_serving(False)
        self._server.stop(grace).wait()
