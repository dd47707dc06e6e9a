"""Helpers of the orchestrator's integration tests (a uniquely named module: every test folder has a
conftest.py, so `from conftest import ...` would pick whichever was imported first).

`InferenceReplica` runs a real `gyre inference`; `SimulatedTrainer` consumes the real stream and publishes
real weights; `orchestrator_config` makes CI-sized configs.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from gyre.config import load_config
from gyre.config.orchestrator import OrchestratorConfig
from gyre.streams import BatchStream, StepReader
from gyre.v1 import inference_pb2, inference_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc
from gyre.weights import WeightStore

READY = re.compile(r"^ready: (http://\S+) control: (\S+) version: (\d+)$")
MODEL_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja")  # fmt: skip


class InferenceReplica:
    """`gyre inference` on free ports in its own process group; `stop()` is graceful, `kill()` is SIGKILL."""

    def __init__(self, model: Path, log_dir: Path, *args: str, timeout: float = 180.0):
        self.log_path = log_dir / f"inference-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop/kill)
        cmd = [sys.executable, "-m", "gyre.cli", "inference", "--model.name", str(model), "--server.port", "0",
               "--control.port", "0", "--engine.threads", "1", *args]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, text=True, start_new_session=True,
                                     env=env)  # fmt: skip
        found: list[str] = []
        done = threading.Event()

        def read():
            for line in self.proc.stdout:
                if READY.match(line.strip()):
                    found.append(line.strip())
                    done.set()
            done.set()

        threading.Thread(target=read, daemon=True).start()
        done.wait(timeout)
        if not found:
            self.kill()
            raise RuntimeError(f"inference did not become ready:\n{self.log_path.read_text()[-3000:]}")
        m = READY.match(found[0])
        self.url, self.control = m.group(1), m.group(2)

    def status(self) -> inference_pb2.GetInferenceStatusResponse:
        with grpc.insecure_channel(self.control) as channel:
            return inference_pb2_grpc.InferenceControlStub(channel).GetStatus(
                inference_pb2.GetInferenceStatusRequest(), timeout=10
            )

    def reload_base(self) -> None:
        with grpc.insecure_channel(self.control) as channel:
            inference_pb2_grpc.InferenceControlStub(channel).ReloadWeights(
                inference_pb2.ReloadWeightsRequest(), timeout=60
            )

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


def orchestrator_config(tmp_path: Path, redis_url: str, run_id: str, replicas, **overrides) -> OrchestratorConfig:
    """A CI-sized config: reverse_text, 2 tasks x 4 samples, 16 tokens, free ports, no final-weights wait."""
    values = {
        "run_id": run_id,
        "output_dir": str(tmp_path / "run"),
        "redis": {"url": redis_url},
        "batch_size": 2,
        "rollouts_per_example": 4,
        "sampling": {"max_tokens": 16},
        "batch": {"seq_len": 256},
        "server": {"port": 0},
        "metrics": {"port": 0},
        "final_weights_timeout_s": 0,
        "inference": {
            "urls": [r.url for r in replicas],
            "control_urls": [r.control for r in replicas],
            "health_interval_s": 0.5,
            "failure_cooldown_s": 1.0,
            "timeout_s": 60,
        },
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key] = {**values[key], **value}
        else:
            values[key] = value
    return load_config(OrchestratorConfig, [], **values)


def publish_weights(store: WeightStore, step: int, model: Path):
    """Publish `model`'s files as weights version `step` (what the trainer does after a step)."""

    def write(folder: Path) -> None:
        for name in MODEL_FILES:
            if (model / name).exists():
                shutil.copy(model / name, folder / name)

    return store.publish(step, write)


async def notify_weights(address: str, published, token: str | None = None) -> orchestrator_pb2.NotifyWeightsResponse:
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    async with grpc.aio.insecure_channel(address) as channel:
        return await orchestrator_pb2_grpc.OrchestratorStub(channel).NotifyWeights(
            orchestrator_pb2.NotifyWeightsRequest(version=published.to_proto()),
            timeout=30,
            metadata=metadata,
        )


class SimulatedTrainer:
    """Consumes batches in step order from the real stream (consumer group, acks after publishing), checks
    they decode, publishes weights version s (the base model's files) and calls NotifyWeights(s)."""

    def __init__(self, redis_url: str, run_id: str, output_dir: Path, model: Path, address, train_s: float = 0.0):
        self.stream = BatchStream(redis_url, run_id)
        self.reader = StepReader(self.stream, "sim-trainer")
        self.store = WeightStore(output_dir / "weights")
        self.model = model
        self.address = address  # callable -> "host:port" of the orchestrator (known once it started)
        self.train_s = train_s
        self.batches = []

    async def run(self, steps: int) -> None:
        while len(self.batches) < steps:
            entry = await asyncio.to_thread(self.reader.next, 500)
            if entry is None:
                continue
            batch = entry.decode()
            self.batches.append(batch)
            await asyncio.sleep(self.train_s)
            published = await asyncio.to_thread(publish_weights, self.store, batch.step, self.model)
            await notify_weights(self.address(), published)
            self.reader.done(entry)

    def close(self) -> None:
        self.stream.redis.close()


async def first_batch(cfg: OrchestratorConfig, model: Path, timeout: float = 120):
    """Run an orchestrator (its `max_steps` must be 1) to the end and return the batch it pushed, as a
    trainer reads it from the stream (no weights are published: the run ends after one batch)."""
    from gyre_orchestrator.service import OrchestratorService

    service = OrchestratorService(cfg)
    trainer = SimulatedTrainer(cfg.redis.url, cfg.run_id, cfg.output_dir, model, lambda: "unused")
    try:
        assert await asyncio.wait_for(service.run(), timeout=timeout) == 0
        entry = await asyncio.to_thread(trainer.reader.next, 5000)
        assert entry is not None, "the orchestrator pushed no batch"
        return entry.decode()
    finally:
        trainer.close()
