"""The RL trainer loop: batch `s` in, one optimizer step, weights `s` out, orchestrator notified.

Per step, in this order (the order is what makes every step train exactly once, see
`gyre_trainer.checkpoint.plan_resume` for the crash analysis):

    1. batch s      rank 0 reads it from Redis (consumer group, strict order), all ranks get it
    2. train        one optimizer step (gyre_trainer.step.train_step) on this rank's micro batches
    3. checkpoint   when s % ckpt.interval == 0: model, optimizer, scheduler, RNG, progress (atomic)
    4. publish      full state dict gathered on rank 0, weights/step_s written atomically  <- commit
    5. log          one line in events/trainer_steps.jsonl, metrics, gRPC status
    6. ack          the Redis entry of batch s
    7. notify       Orchestrator/NotifyWeights(s) from a background thread (never blocks, never raises)

On start the trainer resumes from the run's own durable state (checkpoints and published weights)
and re-logs / re-publishes whatever a crash left half done, then continues with batch `s + 1`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from gyre.config.trainer import TrainerConfig
from gyre.events import TRAINER_STEPS, EventLog, events_dir, read_events
from gyre.net import bind_or_explain
from gyre.runlock import RunLock
from gyre.transport import open_store
from gyre.wandb_log import WandbLogger

from gyre_trainer import dist
from gyre_trainer.checkpoint import CheckpointManager, ResumePlan, plan_resume
from gyre_trainer.intake import BatchIntake, IntakeItem
from gyre_trainer.metrics import TrainerMetrics, serve
from gyre_trainer.publish import RESUME_ADAPTER, WEIGHTS_FILE, WeightPublisher, WeightsNotifier
from gyre_trainer.server import TrainerServer, TrainerStatus

log = logging.getLogger(__name__)

# Fault injection for the crash-consistency tests: "after_publish:3,after_train:5" makes rank 0
# SIGKILL itself at that point of that step (points: after_train, after_checkpoint, after_publish,
# after_log, after_ack). Unset in production; reading one env var per step costs nothing.
CRASH_ENV = "GYRE_TRAINER_CRASH_AT"


def crash_point(name: str, step: int, ctx: dist.DistContext) -> None:
    spec = os.environ.get(CRASH_ENV)
    if spec and ctx.is_main and f"{name}:{step}" in spec.split(","):
        log.warning("fault injection: SIGKILL at %s of step %d", name, step)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


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
    """What every trainer process does around its training, shared by `Trainer` (one run) and
    `multirun.MultiRunTrainer` (N runs): the servers (node health on local rank 0, /metrics and gRPC status
    on rank 0), the base model, readiness, and the run → ready → loop → close lifecycle."""

    def __init__(self, cfg: TrainerConfig, ctx: dist.DistContext):
        self.cfg, self.ctx = cfg, ctx
        self.stop_requested = threading.Event()
        self.status = TrainerStatus(world_size=ctx.world_size)
        self.health: NodeHealth | None = None
        self.server: TrainerServer | None = None
        self.metrics_server = None
        self.metrics_port: int | None = None
        self.grpc_port: int | None = None

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

    def _start_servers(self) -> None:
        cfg = self.cfg
        if cfg.server.health_port is not None and self.ctx.local_rank == 0:
            self.health = NodeHealth(cfg.server.host, cfg.server.health_port)
        if not self.ctx.is_main:
            return
        self.metrics_server, self.metrics_port = bind_or_explain(
            lambda: serve(self.metrics, cfg.metrics.port, cfg.server.host), "trainer", "metrics.port", cfg.metrics.port
        )
        self.server = TrainerServer(self.status, cfg.server.host, cfg.server.port)
        self.grpc_port = bind_or_explain(self.server.start, "trainer", "server.port", cfg.server.port)

    def _load_base_model(self) -> torch.nn.Module:
        """Seed, then the base model on this rank's device; sets dtype, hf_config and peak_flops."""
        from gyre_trainer.model import load_model, resolve_dtype
        from gyre_trainer.perf import peak_flops

        cfg, ctx = self.cfg, self.ctx
        dist.seed_everything(cfg.seed, cfg.deterministic)
        self.dtype = resolve_dtype(cfg.model.dtype, ctx.device)
        model = load_model(cfg.model, ctx.device, self.dtype, activation_checkpointing=cfg.activation_checkpointing)
        self.hf_config = model.config
        self.peak_flops = peak_flops(ctx.device, self.dtype)
        return model

    def _checkpoint_if_due(self, step: int, checkpoints: CheckpointManager, optimizer, scheduler,
                           record: dict[str, Any], metrics: TrainerMetrics) -> None:  # fmt: skip
        """Step `step`'s checkpoint when `ckpt.interval` says so (before publishing: see `plan_resume`)."""
        if self.cfg.ckpt.interval and step % self.cfg.ckpt.interval == 0:
            start = time.perf_counter()
            checkpoints.save(step, self.model, optimizer, scheduler, record)
            metrics.checkpoint_duration.observe(time.perf_counter() - start)
            crash_point("after_checkpoint", step, self.ctx)

    def _close(self) -> None:
        if self.health:
            self.health.close()
        if self.server:
            self.server.stop(grace=1.0)
        if self.metrics_server:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()


def weights_notifier(orchestrator: Any, control_token: str | None) -> WeightsNotifier:
    """The notifier of one run's orchestrator (`trainer.orchestrator`, or a multi-run run's own)."""
    o = orchestrator
    return WeightsNotifier(o.address, timeout_s=o.timeout_s, control_token=control_token,
                           retry_initial_s=o.retry_initial_s, retry_max_s=o.retry_max_s)  # fmt: skip


def log_if_missing(events: EventLog, step: int, *sources: Any) -> bool:
    """A crash between publishing and logging step `s` leaves it unlogged: log it from the first of
    `sources` (publisher, checkpoints) that holds its record. True when it logged."""
    if any(r.get("step") == step for r in read_events(events.path)):
        return False
    record = next((r for r in (source.read_record(step) for source in sources) if r is not None), None)
    if record is not None:
        events.append(record)
    return record is not None


def resume(run: Any, model, ctx: dist.DistContext, resume_step: int | None, lora, publish, adapter: str = "default",
           label: str = "") -> ResumePlan:  # fmt: skip
    """Reconstruct `run`'s last committed step onto `model` (rank 0 plans, every rank loads): drop what a
    rewind discards, load the checkpoint, then the newer published weights, republish (`publish(step,
    record)`) a checkpoint newer than every version, and log and notify what a crash may have left undone.
    `run` holds one run's pieces (checkpoints, publisher, transport, events, notifier, metrics, optimizer,
    scheduler): the single-run `Trainer`, or a multi-run `Run` whose adapter is `adapter`."""
    plan = None
    if ctx.is_main:
        plan = plan_resume(resume_step, run.checkpoints.steps(), run.transport.latest())
        if plan.discard_after is not None:
            dropped = run.checkpoints.discard_after(plan.discard_after), run.publisher.discard_after(plan.discard_after)
            log.warning("%srewinding to step %d: discarded checkpoints %s and weights %s", label, plan.discard_after,
                        *dropped)  # fmt: skip
    plan = dist.broadcast_object(plan, ctx)
    if plan.checkpoint_step is not None:
        run.checkpoints.load(plan.checkpoint_step, model, run.optimizer, run.scheduler)
    if plan.weights_step is not None:
        load_published(model, run.transport.store.path(plan.weights_step), plan, lora, adapter)
        for _ in range(plan.weights_step - (plan.checkpoint_step or 0)):  # the schedule counts updates
            run.scheduler.step()
        log.warning("%sparameters restored from published weights step %d, optimizer state from %s: resumed state "
                    "is not bit-exact (set ckpt.interval=1 for exact resumes)", label, plan.weights_step,
                    f"checkpoint {plan.checkpoint_step}" if plan.checkpoint_step else "scratch")  # fmt: skip
    if plan.republish:  # the checkpoint is newer than every published version: commit it now
        publish(plan.trained_step, run.checkpoints.read_record(plan.trained_step) or {"step": plan.trained_step})
    if ctx.is_main and plan.trained_step > 0:
        if log_if_missing(run.events, plan.trained_step, run.publisher, run.checkpoints):
            log.info("%slogged step %d from its published record (the previous run died before logging it)",
                     label, plan.trained_step)  # fmt: skip
        if not plan.republish:  # the previous run may have died before its notification went out
            run.notifier.notify(run.transport.version(plan.trained_step))
    run.metrics.step.set(plan.trained_step)
    return plan


def load_published(model, folder: Path, plan: ResumePlan, lora, adapter: str = "default") -> None:
    """Published weights version `folder` onto `model`: the full weights, or with `lora` the adapter alone
    (published as such, or kept beside merged weights) onto adapter `adapter` of the base."""
    from safetensors.torch import load_file

    if lora is None:
        dist.load_full_state_dict(model, load_file(folder / WEIGHTS_FILE))
        return
    from gyre_trainer.lora import ADAPTER_FILE, adapter_from_file

    file = next((folder / n for n in (ADAPTER_FILE, RESUME_ADAPTER) if (folder / n).is_file()), None)
    if file is None:  # published by a Gyre that kept no adapter with merged weights
        raise RuntimeError(
            f"LoRA run: published weights step {plan.weights_step} hold no adapter ({folder}); resume "
            f"needs a checkpoint of that step, or ckpt.resume_step = {plan.checkpoint_step or 0}"
        )
    try:
        tensors = adapter_from_file(model, load_file(file), adapter)
    except ValueError as error:  # e.g. re-launched with another lora.rank: say so before anything trains
        raise ValueError(f"LoRA run: published weights step {plan.weights_step}: {error}") from None
    dist.load_full_state_dict(model, tensors, trainable_only=True)


class Trainer(TrainerProcess):
    """Owns the model, optimizer, intake, publisher and servers of one trainer process (one rank)."""

    def __init__(self, cfg: TrainerConfig, ctx: dist.DistContext):
        super().__init__(cfg, ctx)
        self.output_dir = Path(cfg.output_dir)
        self.transport = open_store(cfg.weights, self.output_dir)
        self.publisher = WeightPublisher(self.transport, cfg.model.name, cfg.weights_keep_last)
        self.checkpoints = CheckpointManager(
            self.output_dir / "checkpoints" / "trainer", ctx, cfg.ckpt.keep_last, cfg.ckpt.keep_interval
        )
        self.metrics = TrainerMetrics(cfg.run_id)
        self.notifier: WeightsNotifier | None = None
        self.events: EventLog | None = None
        self.intake: BatchIntake | None = None
        self._rejected_seen = 0
        self.lock: RunLock | None = None

    # ---- lifecycle ------------------------------------------------------------------------------
    def _prepare(self) -> None:
        self._build()
        plan = self._resume()
        self.intake = self._open_intake(plan.trained_step)

    def _start_servers(self) -> None:
        if self.ctx.is_main:
            self.lock = RunLock(self.output_dir, "trainer").acquire()  # one trainer (rank 0) per run folder
        super()._start_servers()
        if not self.ctx.is_main:
            return
        self.events = EventLog(events_dir(self.output_dir) / TRAINER_STEPS)
        self.wandb = WandbLogger(self.cfg.wandb, service="trainer", run_id=self.cfg.run_id,
                                 output_dir=self.output_dir, config=self.cfg.model_dump(mode="json"))  # fmt: skip
        self.notifier = weights_notifier(self.cfg.orchestrator, self.cfg.orchestrator.control_token)

    def _build(self) -> None:
        from gyre_trainer.model import load_model
        from gyre_trainer.optim import build_optimizer, build_scheduler

        cfg, ctx = self.cfg, self.ctx
        model = self._load_base_model()
        if cfg.lora is not None:  # adapters only: the optimizer below takes the trainable parameters
            from gyre_trainer.lora import apply_lora

            model = apply_lora(model, cfg.lora)
        self.model = dist.shard_model(model, ctx)
        self.optimizer = build_optimizer(self.model, cfg.optim, cfg.lora.lr_ratio_b if cfg.lora else 1.0)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.max_steps)
        self.ref_model = None
        if cfg.loss.ref_kl_coef > 0 and cfg.lora is not None:  # the base is in the model: adapters off
            from gyre_trainer.lora import AdaptersOff

            self.ref_model = AdaptersOff(self.model)
        elif cfg.loss.ref_kl_coef > 0:  # frozen copy of the base model for the KL term
            ref = load_model(cfg.model, ctx.device, self.dtype).eval().requires_grad_(False)
            self.ref_model = dist.shard_model(ref, ctx)

    def _close(self) -> None:
        super()._close()
        if self.notifier:
            self.notifier.close(timeout=2.0)
        if self.events:
            self.events.close()
        if self.lock:
            self.lock.release()
        if getattr(self, "wandb", None):
            self.wandb.finish()

    # ---- resume ---------------------------------------------------------------------------------
    def _resume(self) -> ResumePlan:
        """Reconstruct the state of the last committed step (rank 0 plans, every rank loads)."""
        plan = resume(self, self.model, self.ctx, self.cfg.ckpt.resume_step, self.cfg.lora, self._publish)
        self.status.resumed(self.cfg.run_id, plan.trained_step)
        log.info("resuming after step %d (%s)", plan.trained_step, plan)
        return plan

    def _open_intake(self, trained_step: int) -> BatchIntake:
        stream = None
        if self.ctx.is_main:
            from gyre.streams import BatchStream

            client = self.cfg.redis.client(socket_timeout=30, socket_connect_timeout=5)
            stream = BatchStream(client, self.cfg.run_id)
        return BatchIntake(
            self.ctx,
            stream,
            trained_step,
            vocab_size=self.hf_config.vocab_size,
            poll_ms=self.cfg.intake.poll_ms,
            should_stop=self.stop_requested.is_set,
        )

    # ---- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        cfg, main = self.cfg, self.ctx.is_main
        while cfg.max_steps is None or self.intake.trained_step < cfg.max_steps:
            item = self.intake.next(self.stop_requested.is_set)
            if item is None:
                log.info("stop requested: leaving after step %d", self.intake.trained_step)
                return
            record, mfu_per_rank = self._train(item)
            crash_point("after_train", item.step, self.ctx)
            self._checkpoint_if_due(item.step, self.checkpoints, self.optimizer, self.scheduler, record, self.metrics)
            self._publish(item.step, record)
            if main:
                self.events.append(record)
                self.wandb.log(record)
                self.metrics.observe_step(record, mfu_per_rank)
                self.metrics.rejected.inc(self.intake.rejected - self._rejected_seen)
                self._rejected_seen = self.intake.rejected
                self.status.update(item.step, record["num_tokens"], self.cfg.run_id)
                crash_point("after_log", item.step, self.ctx)
            self.intake.commit(item)
            crash_point("after_ack", item.step, self.ctx)
            if main:
                self.publisher.prune()
        log.info("reached max_steps=%d", cfg.max_steps)

    def _train(self, item: IntakeItem) -> tuple[dict[str, Any], list[float]]:
        """One optimizer step; returns the step's event record and every rank's MFU."""
        from gyre_trainer.perf import MFUMeter, effective_seq_len, flops_per_token
        from gyre_trainer.step import train_step

        cfg, ctx = self.cfg, self.ctx
        start = time.perf_counter()
        result = train_step(
            self.model,
            self.optimizer,
            self.scheduler,
            item.batch,
            rank=ctx.rank,
            world_size=ctx.world_size,
            loss_cfg=cfg.loss,
            micro_batch_size=cfg.data.micro_batch_size,
            ref_model=self.ref_model,
            max_grad_norm=cfg.optim.max_grad_norm,
        )
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        seconds = time.perf_counter() - start
        lengths = [int(n) for mb in item.batch.for_rank(ctx.rank) for n in mb.sample_lengths]
        meter = MFUMeter(flops_per_token(self.hf_config, effective_seq_len(lengths)), self.peak_flops)
        mfu_per_rank = [v[0] for v in dist.gather_floats([meter.reading(sum(lengths), seconds).mfu], ctx)]
        return step_record(item, result.metrics, seconds, sum(mfu_per_rank) / len(mfu_per_rank)), mfu_per_rank

    def _publish(self, step: int, record: dict[str, Any]) -> None:
        """Gather the full weights (every rank), publish them and queue the notification (rank 0).

        Publishing is the commit point of a step: from here on, a restarted trainer treats it as trained.
        """
        start = time.perf_counter()
        lora = self.cfg.lora
        adapter_only = lora is not None and lora.publish == "adapter"
        state_dict = dist.full_state_dict(self.model, self.ctx, trainable_only=adapter_only)
        if not self.ctx.is_main:
            return
        if adapter_only:
            published = self.publisher.publish_adapter(step, state_dict, lora, record)
        else:
            adapter = None
            if lora is not None:  # merged: every backend serves it like a full model; the adapter is kept too
                from gyre_trainer.lora import adapter_state_dict, merged_state_dict

                adapter = adapter_state_dict(state_dict)
                state_dict = merged_state_dict(state_dict, lora)
            published = self.publisher.publish(step, state_dict, self.hf_config, record, adapter=adapter)
        self.metrics.publish_duration.observe(time.perf_counter() - start)
        crash_point("after_publish", step, self.ctx)
        self.notifier.notify(published)


def step_record(item: IntakeItem, metrics: dict[str, float], seconds: float, mfu: float) -> dict[str, Any]:
    """The `trainer_steps.jsonl` line of a step (docs/architecture.md, Event logs) plus a few extras."""
    versions = [(s.get("min_version"), s.get("max_version")) for s in item.batch.samples]
    mins = [v for v, _ in versions if isinstance(v, int)]
    maxs = [v for _, v in versions if isinstance(v, int)]
    record = {
        "step": item.step,
        "loss": metrics.get("loss"),
        "entropy": metrics.get("entropy"),
        "mismatch_kl": metrics.get("mismatch_kl"),
        "grad_norm": metrics.get("grad_norm"),
        "lr": metrics.get("lr"),
        "num_tokens": int(metrics.get("num_tokens", item.batch.num_tokens)),
        "num_samples": item.batch.num_samples,
        "step_seconds": seconds,
        "mfu": mfu,
        "min_version": min(mins) if mins else None,
        "max_version": max(maxs) if maxs else None,
        "time": time.time(),
    }
    if "num_loss_tokens" in metrics:
        record["num_loss_tokens"] = int(metrics["num_loss_tokens"])
    # the objective's and the correction's stats (clip_frac, masked_frac, is_weight, ...; docs/algorithms.md)
    record.update({k: v for k, v in metrics.items()
                   if k.endswith("_frac") or k in ("is_weight", "ref_kl", "teacher_kl", "skipped")})  # fmt: skip
    return record


def run(cfg: TrainerConfig, *, handle_signals: bool = True) -> int:
    """Run the trainer until `max_steps` or SIGTERM/SIGINT (which finish the current step first).

    `handle_signals=False` leaves the process's signal handlers alone (a trainer embedded in a test).
    """
    ctx = dist.init_distributed(cfg.device)
    if cfg.runs or cfg.runs_dir:  # one LoRA adapter per run on one base model (gyre_trainer.multirun)
        from gyre_trainer.multirun import MultiRunTrainer

        trainer = MultiRunTrainer(cfg, ctx)
    else:
        trainer = Trainer(cfg, ctx)

    def request_stop(signum, _frame) -> None:
        log.info("signal %d: finishing the current step, then stopping", signum)
        trainer.stop_requested.set()
        if trainer.health:
            trainer.health.ready.clear()

    if handle_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, request_stop)
    try:
        return trainer.run()
    finally:
        dist.shutdown(ctx)
