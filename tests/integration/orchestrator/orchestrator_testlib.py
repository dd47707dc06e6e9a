"""Helpers of the orchestrator's integration tests (a uniquely named module: every test folder has a
conftest.py, so `from conftest import ...` would pick whichever was imported first).

`SimulatedTrainer` consumes the real stream and publishes real weights; `orchestrator_config` makes CI-sized
configs (real replicas: `support.inference`).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
from gyre.config import load_config
from gyre.config.orchestrator import OrchestratorConfig
from gyre.streams import BatchStream, StepReader
from gyre.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from gyre.weights import WeightStore

MODEL_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja")  # fmt: skip


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
