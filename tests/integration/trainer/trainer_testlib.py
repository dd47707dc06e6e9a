"""Helpers for the trainer service tests: synthetic batches, a trainer subprocess, weight comparison.

Batches are built directly as `TrainBatch` objects (random tokens, a prompt part outside the loss
and a completion part inside it) and pushed with the real `BatchStream`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from gyre.batch import MicroBatch, TrainBatch
from gyre.codec import encode_batch
from gyre.events import TRAINER_STEPS, read_events
from gyre.streams import BatchStream

REPO = Path(__file__).resolve().parents[3]
PYTHON = sys.executable


def make_samples(step: int, num_samples: int = 4, vocab: int = 1024, seed: int = 0) -> list[dict]:
    """`num_samples` samples of varying length for `step` (deterministic in (step, seed))."""
    rng = np.random.default_rng(seed * 10_007 + step)
    samples = []
    for i in range(num_samples):
        prompt, completion = int(rng.integers(3, 8)), int(rng.integers(4, 12))
        n = prompt + completion
        samples.append(
            {
                "input_ids": rng.integers(3, vocab, n),
                "loss_mask": np.arange(n) >= prompt,
                "advantages": np.full(n, 1.0 if i % 2 == 0 else -1.0),
                "inference_logprobs": np.where(np.arange(n) >= prompt, -rng.uniform(4.0, 9.0, n), 0.0),
                "sample_index": i,
            }
        )
    return samples


def make_batch(step: int, *, ranks: int = 1, rows_per_rank: int = 2, num_samples: int = 4, seed: int = 0) -> TrainBatch:
    """Batch `step`: the samples dealt round-robin into `ranks * rows_per_rank` packed rows.

    The same (step, num_samples, seed) gives the same samples whatever `ranks` is, so a 2-rank
    batch and a 1-rank batch hold the same data (what the FSDP2-vs-single-process test needs).
    """
    samples = make_samples(step, num_samples, seed=seed)
    rows = ranks * rows_per_rank
    packed = [MicroBatch.from_samples(samples[r::rows]) for r in range(rows)]
    if ranks == 1:
        micro_batches = [packed]
    else:
        micro_batches = [packed[r * rows_per_rank : (r + 1) * rows_per_rank] for r in range(ranks)]
    meta = [{"min_version": max(step - 2, 0), "max_version": step - 1} for _ in samples]
    return TrainBatch(
        step=step,
        micro_batches=micro_batches,
        samples=meta,
        num_loss_tokens=int(sum(np.count_nonzero(s["loss_mask"]) for s in samples)),
        num_samples=len(samples),
        created=1.0,
    ).validate()


def push_batches(stream: BatchStream, steps, **kwargs) -> None:
    for step in steps:
        stream.push(step, encode_batch(make_batch(step, **kwargs)))


def trainer_args(model_dir: Path, output_dir: Path, redis_url: str, run_id: str, max_steps: int, **extra) -> list[str]:
    """argv of `gyre trainer` for a tiny deterministic CPU run on free ports."""
    opts = {
        "model.name": str(model_dir),
        "output-dir": str(output_dir),
        "redis.url": redis_url,
        "run-id": run_id,
        "max-steps": max_steps,
        "device": "cpu",
        "deterministic": "true",
        "optim.lr": 1e-3,
        "metrics.port": 0,
        "server.port": 0,
        "intake.poll-ms": 200,
        "orchestrator.address": "127.0.0.1:9",  # nothing listens: notifications fail quietly
        "orchestrator.timeout-s": 0.5,
        **extra,
    }
    argv = []
    for key, value in opts.items():
        argv += [f"--{key}", str(value)]
    return argv


def child_env(threads: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    env.pop("GYRE_TRAINER_CRASH_AT", None)
    env.pop("GYRE_TRAINER_HOLD_AT", None)
    return env


def start_trainer(
    argv: list[str], log_path: Path, env: dict | None = None, max_file_bytes: int | None = None
) -> subprocess.Popen:
    """`python -m gyre_trainer.main argv` in its own process group, logging to `log_path`. `max_file_bytes`: no file
    the trainer writes may grow beyond it (RLIMIT_FSIZE: EFBIG, what a full volume does to a writer)."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    log = open(log_path, "ab")  # noqa: SIM115 - closed when the process is reaped by the caller
    return subprocess.Popen(
        [PYTHON, "-m", "gyre_trainer.main", *argv],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env or child_env(),
        cwd=REPO,
        start_new_session=True,
        preexec_fn=limit if max_file_bytes is not None else None,
    )


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """`sig` to `proc`'s process group and to every process descended from it in another group: torchrun starts
    each worker in a session of its own, so a torchrun killed at a test's timeout left its trainers running."""
    stray = [pid for pid in descendants(proc.pid) if _pgid(pid) not in (None, proc.pid)]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    for pid in stray:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    proc.wait(timeout=30)


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):  # gone meanwhile, or not ours to read
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def wait_for_steps(output_dir: Path, n: int, proc: subprocess.Popen | None = None, timeout: float = 120) -> list[int]:
    """Wait until the trained-steps log has `n` lines (or the process exits); returns the steps."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = trained_steps(output_dir)
        if len(steps) >= n or (proc is not None and proc.poll() is not None):
            return steps
        time.sleep(0.05)
    raise TimeoutError(f"only {trained_steps(output_dir)} trained after {timeout}s")


def trained_steps(output_dir: Path) -> list[int]:
    return [r["step"] for r in read_events(Path(output_dir) / "events" / TRAINER_STEPS)]


def load_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(Path(folder) / "model.safetensors")


class RecordingOrchestrator:
    """A real gRPC `gyre.v1.Orchestrator` server that records every NotifyWeights call.

    `port` may be fixed (to bring an orchestrator "back up" on the address a trainer already uses).
    """

    def __init__(self, port: int = 0, token: str | None = None):
        from concurrent import futures

        import grpc
        from gyre.v1 import orchestrator_pb2, orchestrator_pb2_grpc

        calls = self.calls = []
        self.metadata: list[dict] = []
        outer = self

        class Servicer(orchestrator_pb2_grpc.OrchestratorServicer):
            def NotifyWeights(self, request, context):  # noqa: N802
                meta = dict(context.invocation_metadata())
                outer.metadata.append(meta)
                if token and meta.get("authorization") != f"Bearer {token}":
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")
                v = request.version
                calls.append((v.step, v.locator, v.digest))
                return orchestrator_pb2.NotifyWeightsResponse(accepted=True, latest_step=v.step)

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def steps(self) -> list[int]:
        return [step for step, _, _ in self.calls]

    def stop(self) -> None:
        self.server.stop(0).wait()


def run_in_process(argv: list[str]) -> int:
    """`gyre trainer argv` inside this process (use with the `isolated_torch_state` fixture)."""
    from gyre.config import load_config
    from gyre.config.trainer import TrainerConfig
    from gyre_trainer import service

    return service.run(load_config(TrainerConfig, argv), handle_signals=False)


def torchrun(argv: list[str], log_path: Path, nproc: int = 2, timeout: float = 300, env: dict | None = None) -> int:
    """`torchrun --standalone --nproc-per-node nproc -m gyre_trainer.main argv`; returns the exit code."""
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [*cmd, "-m", "gyre_trainer.main", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env or child_env(),
            cwd=REPO,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                kill_group(proc)


#: `gyre sft --lora`: a small adapter on three of the tiny model's layers
LORA = json.dumps({"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]})


def sft_args(model, out, **extra) -> list[str]:
    """`gyre sft` arguments of a small CPU run of `model` into `out` (`extra`: more keys, without the dashes)."""
    opts = {
        "model.name": model, "output-dir": out, "device": "cpu", "deterministic": "true",
        "data.seq-len": 64, "data.batch-size": 4, "data.micro-batch-size": 2, "optim.lr": 3e-3, **extra,
    }  # fmt: skip
    return [x for key, value in opts.items() for x in (f"--{key}", str(value))]
