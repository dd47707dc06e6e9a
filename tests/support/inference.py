"""A real `gyre inference` replica for tests: free ports, one thread, its own process group and log file.

`InferenceServer` is `gyre.inference_process.InferenceProcess` (the helper `gyre rl` and the benches use)
started and waited for, plus the control calls tests need. `stop()` is the graceful SIGTERM path (it
returns the exit status), `kill()` is a crash.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
from gyre.inference_process import InferenceProcess
from gyre.v1 import inference_pb2, inference_pb2_grpc

TEST_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
DEFAULTS = ("--server.port", "0", "--control.port", "0", "--engine.threads", "1", "--server.shutdown-grace-s", "20")


class InferenceServer(InferenceProcess):
    """`gyre inference --model.name MODEL ARGS` on free ports, ready when constructed."""

    def __init__(self, model: Path | str, *args: str, log_dir: Path, timeout: float = 180.0):
        self.model_name = str(model)  # the served model id (no served_model_name given)
        log_path = Path(log_dir) / f"inference-{time.monotonic_ns()}.log"
        super().__init__("--model.name", str(model), *DEFAULTS, *args, log_path=log_path)
        self.start(env=TEST_ENV, quiet=True)
        try:
            self.start_version = self.wait_ready(timeout).version
        except BaseException:
            self.kill()
            raise

    def stop(self, timeout: float = 60.0) -> int | None:
        return super().stop(timeout)

    def status(self, model: str = "") -> inference_pb2.GetInferenceStatusResponse:
        with grpc.insecure_channel(self.control) as channel:
            return inference_pb2_grpc.InferenceControlStub(channel).GetStatus(
                inference_pb2.GetInferenceStatusRequest(model=model), timeout=10
            )

    def reload_base(self) -> None:
        """Back to the base model (version 0), as a fresh replica."""
        with grpc.insecure_channel(self.control) as channel:
            inference_pb2_grpc.InferenceControlStub(channel).ReloadWeights(
                inference_pb2.ReloadWeightsRequest(), timeout=60
            )
