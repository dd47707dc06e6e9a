"""gRPC `gyre.v1.Trainer` (GetStatus) plus `grpc.health.v1` and reflection, served by rank 0.

Health is NOT_SERVING until the trainer has loaded (and, when resuming, restored) its state and is
ready to take batches; Kubernetes probes use it natively (`grpc:` probes). GetStatus reads a
`TrainerStatus` that the training loop updates after each published step: the process's totals and one
entry per run (a single-run trainer has one, multi-run one per run, kept after it finishes).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from gyre.grpc_server import ThreadedGrpcServer
from gyre.v1 import trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name


@dataclass
class RunStatus:
    """One run's line of GetStatus."""

    step: int = 0
    last_step_unix: float = 0.0
    tokens: int = 0
    finished: bool = False


@dataclass
class TrainerStatus:
    """What GetStatus reports; updated by the training loop under `lock`."""

    step: int = 0
    last_step_unix: float = 0.0
    tokens: int = 0
    world_size: int = 1
    runs: dict[str, RunStatus] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.lock = threading.Lock()

    def resumed(self, run: str, step: int) -> None:
        """Run `run` (re)starts after `step` (a run added again is training again)."""
        with self.lock:
            self.step = step
            self.runs[run] = RunStatus(step=step)

    def update(self, step: int, tokens: int, run: str) -> None:
        with self.lock:
            self.step = step
            self.tokens += tokens
            self.last_step_unix = time.time()
            entry = self.runs.setdefault(run, RunStatus())
            entry.step, entry.last_step_unix = step, self.last_step_unix
            entry.tokens += tokens

    def finished(self, run: str) -> None:
        with self.lock:
            self.runs.setdefault(run, RunStatus()).finished = True


class _TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, status: TrainerStatus):
        self.status = status

    def GetStatus(self, request, context):  # noqa: N802 (gRPC method name)
        s = self.status
        with s.lock:
            runs = [trainer_pb2.TrainerRunStatus(name=name, step=r.step, last_step_unix=r.last_step_unix,
                                                 tokens=r.tokens, finished=r.finished)
                    for name, r in sorted(s.runs.items())]  # fmt: skip
            return trainer_pb2.GetTrainerStatusResponse(
                step=s.step, last_step_unix=s.last_step_unix, tokens=s.tokens, world_size=s.world_size, runs=runs
            )


class TrainerServer(ThreadedGrpcServer):
    """The trainer's gRPC server (`gyre.grpc_server`); `start()` returns the bound port (port 0 = a free one)."""

    def __init__(self, status: TrainerStatus, host: str = "127.0.0.1", port: int = 0):
        super().__init__(SERVICE_NAME, what="the trainer gRPC server")
        self.status = status
        self.host = host
        self.requested_port = port
        trainer_pb2_grpc.add_TrainerServicer_to_server(_TrainerServicer(status), self.server)

    def start(self) -> int:
        port = super().start(self.host, self.requested_port)
        log.info("gRPC gyre.v1.Trainer + health on %s:%d", self.host, port)
        return port

    def stop(self, grace: float = 2.0) -> None:
        super().stop(grace)
