"""The trainer process around its runs: crash points, node health, servers, the base model, the lifecycle.

`TrainerProcess` is what every trainer process does whatever it trains: the servers (node health on local
rank 0 of every node, /metrics and gRPC status on rank 0), the base model, the Redis client its runs read
their batches with, readiness, and the start -> prepare -> ready -> loop -> close lifecycle. What it trains
is one run (`gyre_trainer.service.Trainer`) or N runs (`gyre_trainer.multirun.MultiRunTrainer`), each a
`gyre_trainer.run.RunState`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from gyre.config.trainer import TrainerConfig
from gyre.net import bind_or_explain
from prometheus_client import CollectorRegistry

from gyre_trainer import dist
from gyre_trainer.metrics import serve
from gyre_trainer.server import TrainerServer, TrainerStatus

log = logging.getLogger(__name__)

# Fault injection for the crash-consistency tests: "after_publish:3,after_train:5" makes rank 0
# SIGKILL itself at that point of that step (points between the parts of `RunState.commit`: after_train,
# after_checkpoint, after_publish, after_log, after_ack; inside the optimizer step: mid_step, the parameters
# updated in memory, the LR schedule not yet advanced; and inside the two writes: mid_checkpoint, every
# shard written but the folder not committed, and mid_publish, the weights file written but the version
# not committed). Unset in production; one env read per point.
CRASH_ENV = "GYRE_TRAINER_CRASH_AT"
# The same points in `GYRE_TRAINER_HOLD_AT` hold rank 0 there until a signal's handler raises (a step that is long
# to finish, deterministically: the second-Ctrl-C test).
HOLD_ENV = "GYRE_TRAINER_HOLD_AT"


def crash_point(name: str, step: int, ctx: dist.DistContext | None) -> None:
    """SIGKILL rank 0 here when `GYRE_TRAINER_CRASH_AT` names `name:step`, hold it when `GYRE_TRAINER_HOLD_AT` does.
    `ctx` None: code only rank 0 runs."""
    if ctx is not None and not ctx.is_main:
        return
    if (spec := os.environ.get(CRASH_ENV)) and f"{name}:{step}" in spec.split(","):
        log.warning("fault injection: SIGKILL at %s of step %d", name, step)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
    if (spec := os.environ.get(HOLD_ENV)) and f"{name}:{step}" in spec.split(","):
        log.warning("fault injection: holding at %s of step %d", name, step)
        while True:
            time.sleep(3600)  # a signal's handler runs in between; one that raises ends the hold


@contextlib.contextmanager
def crash_in_optimizer_step(optimizer: torch.optim.Optimizer, step: int, ctx: dist.DistContext) -> Iterator[None]:
    """The `mid_step` crash point of step `step`, inside the optimizer step: an optimizer post-hook, so rank 0 dies
    with the parameters updated in memory but the schedule not advanced and the gradients not cleared. Without
    `GYRE_TRAINER_CRASH_AT` no hook is registered (production pays one env read per step)."""
    if not os.environ.get(CRASH_ENV):
        yield
        return
    handle = optimizer.register_step_post_hook(lambda *_: crash_point("mid_step", step, ctx))
    try:
        yield
    finally:
        handle.remove()


class NodeHealth:
    """HTTP `/health` (the process answers) and `/ready` (this rank is training) of one node.

    Served by local rank 0 of every node, so every trainer pod answers its probes: the gRPC and
    metrics servers exist on global rank 0 only.
    """

    def __init__(self, host: str, port: int):
        self.ready = threading.Event()
        ready = self.ready

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                ok = self.path == "/health" or (self.path == "/ready" and ready.is_set())
                code = 200 if ok else (503 if self.path == "/ready" else 404)
                body = {200: b"ok\n", 503: b"not ready\n", 404: b"not found\n"}[code]
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # probes every few seconds: keep the log quiet
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = int(self.server.server_port)
        threading.Thread(target=self.server.serve_forever, name="trainer-health", daemon=True).start()
        log.info("node health on http://%s:%d/health and /ready", host, self.port)

    def close(self) -> None:
        self.ready.clear()
        self.server.shutdown()
        self.server.server_close()


class TrainerProcess:
    """One trainer process (one rank); subclasses say what it trains (`_prepare`) and how (`_loop`)."""

    def __init__(self, cfg: TrainerConfig, ctx: dist.DistContext):
        self.cfg, self.ctx = cfg, ctx
        self.stop_requested = threading.Event()
        self.step_running = threading.Event()  # set by `RunState.commit`: what a stop signal waits for
        self.status = TrainerStatus(world_size=ctx.world_size)
        self.registry = CollectorRegistry()  # every run's metrics (label run_id), served on /metrics
        self.model: torch.nn.Module | None = None
        self.health: NodeHealth | None = None
        self.server: TrainerServer | None = None
        self.metrics_server = None
        self.metrics_port: int | None = None
        self.grpc_port: int | None = None
        self._redis = None

    def run(self) -> int:
        try:
            self._start_servers()
            self._prepare()
            if self.server:
                self.server.set_serving(True)
            if self.health:
                self.health.ready.set()
            self._loop()
            return 0
        finally:
            self._close()

    def _prepare(self) -> None:
        """Build the model and restore what the run(s) trained, before the process reports ready."""
        raise NotImplementedError

    def _loop(self) -> None:
        raise NotImplementedError

    @property
    def ref_model(self) -> Any:
        """The reference of the KL term (`loss.ref_kl_coef`), or None."""
        return None

    def _start_servers(self) -> None:
        cfg = self.cfg
        if cfg.server.health_port is not None and self.ctx.local_rank == 0:
            self.health = NodeHealth(cfg.server.host, cfg.server.health_port)
        if not self.ctx.is_main:
            return
        self.metrics_server, self.metrics_port = bind_or_explain(
            lambda: serve(self.registry, cfg.metrics.port, cfg.server.host),
            "trainer",
            "metrics.port",
            cfg.metrics.port,
            cfg.server.host,
        )
        self.server = TrainerServer(self.status, cfg.server.host, cfg.server.port)
        self.grpc_port = bind_or_explain(self.server.start, "trainer", "server.port", cfg.server.port, cfg.server.host)

    def redis(self):
        """The process's Redis client (rank 0 reads every run's stream), from the config: `redis.password` too."""
        if self._redis is None:
            self._redis = self.cfg.redis.client(socket_timeout=30, socket_connect_timeout=5)
        return self._redis

    def _load_base_model(self) -> torch.nn.Module:
        """Seed, then the base model on this rank's device; sets dtype, hf_config and peak_flops."""
        from gyre_trainer.model import load_model, resolve_dtype
        from gyre_trainer.perf import peak_flops

        cfg, ctx = self.cfg, self.ctx
        dist.seed_everything(cfg.seed, cfg.deterministic)
        self.dtype = resolve_dtype(cfg.model.dtype, ctx.device)
        model = load_model(cfg.model, ctx.device, self.dtype, activation_checkpointing=cfg.activation_checkpointing,
                           dropout=False)  # fmt: skip
        self.hf_config = model.config
        self.peak_flops = peak_flops(ctx.device, self.dtype)
        return model

    def _close(self) -> None:
        if self.health:
            self.health.close()
        if self.server:
            self.server.stop(grace=1.0)
        if self.metrics_server:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        if self._redis is not None:
            self._redis.close()
            self._redis = None
