"""`gyre bench weights`: publish -> every replica serving it, divided by the disk's own write + read time.

    gyre bench weights                                         # tiny model made in a temp folder, CPU
    gyre bench weights --model /models/Qwen3-0.6B --device cuda --replicas 2 --rounds 5

Per round, on the same volume (`--dir`, default a temp folder), measured side by side:
- **swap**: the trainer's sink publishes a changed state dict (`WeightPublisher.publish`: the tensors'
  memory streamed into model.safetensors while a second thread hashes it and a third flushes it, config
  and tokenizer files, MANIFEST.json, one fsync batch, rename), then every replica
  (a real `gyre inference` process each) gets `UpdateWeights(version)` at once, as the relay sends it,
  and the round ends when the last one answers, i.e. serves the version (verify + load + swap);
- **disk**: writing the same number of bytes to one file in the same folder (fsync) + reading it back.

It prints both (medians), the phases of the swap and `swap / disk` (target <= 1.5). The replicas'
reads come from the page cache, as the disk measurement's read does; the NotifyWeights hop to the
orchestrator (one small gRPC call) is not included.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from gyre.config import GyreSettings, parse_or_exit
from gyre.inference_process import InferenceProcess, start_inference
from gyre.transport import FolderStore
from gyre.weights import WeightsVersion
from pydantic import Field


class WeightsBenchConfig(GyreSettings):
    """Benchmark a weights swap (publish -> all replicas serving) against writing + reading the same bytes."""

    model: str | None = Field(None, description="Model folder (HF format); default: the tiny preset in a temp folder.")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the trainer's weights and the replicas live.")
    replicas: int = Field(2, ge=1, description="`gyre inference` processes to bring to each version.")
    rounds: int = Field(5, ge=1, description="Versions published (medians are reported).")
    dir: Path | None = Field(
        None,
        description="Volume to measure: the versions go to a temporary folder of their own inside it, deleted at the "
        "end (default: a temp folder).",
    )
    full_verify: bool = Field(False, description="Replicas re-hash every file (weights.full_verify).")


def start_replica(model: str, device: str, output_dir: Path, full_verify: bool, log: Path) -> InferenceProcess:
    """A `gyre inference` replica on free ports, ready to take weight updates."""
    args = ["--model.name", model, "--server.port", "0", "--control.port", "0", "--engine.device", device,
            "--output-dir", str(output_dir), "--weights.full_verify", str(full_verify).lower()]  # fmt: skip
    if device == "cpu":
        args += ["--engine.threads", "1"]
    return start_inference(*args, log_path=log, timeout=600, env={"TOKENIZERS_PARALLELISM": "false"})


def update_all(stubs, version: WeightsVersion, pool: ThreadPoolExecutor) -> list[float]:
    """UpdateWeights on every replica at once (as the relay does, from threads that already run, as its
    event loop does); returns each replica's load_seconds."""
    from gyre.v1 import inference_pb2

    request = inference_pb2.UpdateWeightsRequest(version=version.to_proto())
    replies = list(pool.map(lambda stub: stub.UpdateWeights(request, timeout=600), stubs))
    assert all(r.step == version.step for r in replies), replies
    return [r.load_seconds for r in replies]


def disk_write_read(folder: Path, nbytes: int) -> tuple[float, float]:
    """Seconds to write `nbytes` to a new file in `folder` (fsync'd, as publishing does) and to read it back."""
    path = folder / f".bench-{os.getpid()}"
    block = os.urandom(1 << 20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[: min(left, len(block))])
        f.flush()
        os.fsync(f.fileno())
    written = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass
    read = time.perf_counter()
    path.unlink()
    return written - start, read - written


def run_bench(cfg: WeightsBenchConfig) -> dict[str, float]:
    import grpc
    import torch
    from gyre.v1 import inference_pb2_grpc
    from transformers import AutoModelForCausalLM

    from gyre_trainer import dist
    from gyre_trainer.publish import WeightPublisher

    single = dist.DistContext(device=torch.device(cfg.device))  # the trainer's one process
    work = Path(tempfile.mkdtemp(prefix="gyre-bench-weights-"))
    if cfg.dir is not None:  # a folder of its own there: `--dir` a run's folder pruned and then deleted its weights/
        cfg.dir.mkdir(parents=True, exist_ok=True)
        volume = Path(tempfile.mkdtemp(prefix=".gyre-bench-weights-", dir=cfg.dir))
    else:
        volume = work
    model_dir = cfg.model
    if model_dir is None:
        from gyre.model_init import init_model

        model_dir = str(init_model(work / "model", preset="tiny", seed=0))
    dtype = torch.bfloat16 if cfg.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(cfg.device)
    sink = FolderStore(volume / "weights")
    publisher = WeightPublisher(sink, model_dir, keep_last=2)
    replicas = [
        start_replica(model_dir, cfg.device, volume, cfg.full_verify, work / f"inference-{i}.log")
        for i in range(cfg.replicas)
    ]
    channels = [grpc.insecure_channel(r.control) for r in replicas]
    stubs = [inference_pb2_grpc.InferenceControlStub(c) for c in channels]
    callers = ThreadPoolExecutor(len(stubs))
    rows = []
    try:
        for step in range(1, cfg.rounds + 1):
            with torch.no_grad():  # a new version: every tensor changes, as after an optimizer step
                for p in model.parameters():
                    p.add_(1e-3)
            # the trainer publishes what `dist.full_state_dict` gathered to CPU as part of its step (also for
            # checkpoints): that copy (device -> host on a GPU) is timed apart, as `gather`, not in the swap
            gathering = time.perf_counter()
            state = dist.full_state_dict(model, single)
            start = time.perf_counter()
            version = publisher.publish(step, state, model.config, {"step": step})
            published = time.perf_counter()
            loads = update_all(stubs, version, callers)
            served = time.perf_counter()
            nbytes = sum(f.stat().st_size for f in version.path.rglob("*") if f.is_file())
            write_s, read_s = disk_write_read(volume / "weights", nbytes)
            rows.append(
                {"gather": start - gathering, "publish": published - start, "relay": served - published,
                 "load": max(loads), "swap": served - start, "write": write_s, "read": read_s, "bytes": nbytes}
            )  # fmt: skip
            publisher.prune()
            print(
                f"round {step}: {nbytes / 1e6:.1f} MB  swap {rows[-1]['swap']:.3f}s (publish {rows[-1]['publish']:.3f}"
                f" + replicas {rows[-1]['relay']:.3f})  disk write {write_s:.3f}s + read {read_s:.3f}s",
                flush=True,
            )
    finally:
        callers.shutdown()
        for c in channels:
            c.close()
        for r in replicas:
            r.stop()
        shutil.rmtree(work, ignore_errors=True)
        if cfg.dir is not None:
            shutil.rmtree(volume, ignore_errors=True)
    # the first round warms caches and allocators in every process: report the others when there are any
    timed = rows[1:] or rows
    med = {k: statistics.median(r[k] for r in timed) for k in rows[0]}
    med["disk"] = statistics.median(r["write"] + r["read"] for r in timed)
    med["ratio"] = med["swap"] / med["disk"]
    return med


def main(argv: list[str] | None = None) -> int:
    cfg = parse_or_exit(WeightsBenchConfig, sys.argv[1:] if argv is None else argv, prog="gyre bench weights")
    m = run_bench(cfg)
    print(
        f"\nweights swap, {cfg.replicas} replica(s), {m['bytes'] / 1e6:.1f} MB, {cfg.device} (medians):\n"
        f"  publish -> all replicas serving  {m['swap']:.3f} s  (publish {m['publish']:.3f} s, "
        f"replicas {m['relay']:.3f} s of which the slowest load {m['load']:.3f} s)\n"
        f"  write + read the same bytes      {m['disk']:.3f} s  (write {m['write']:.3f} s, read {m['read']:.3f} s)\n"
        f"  (not in the swap: the trainer's step gathers the state dict to CPU first, here {m['gather']:.3f} s)\n"
        f"  swap / disk = {m['ratio']:.2f}  (target <= 1.5)"
    )
    return 0
