"""Multi-run: one trainer process trains N runs on one base model, one LoRA adapter per run.

Each run (`trainer.runs[]`, or a file in `trainer.runs_dir`) has everything a single-run trainer has
except the base model: its own peft adapter (named after the run), AdamW optimizer, LR schedule,
progress, batch stream `gyre:{name}:batches`, output folder (weights, checkpoints, events), lock and
orchestrator. Per step of run `r` (the single-run order of `gyre_trainer.service`, on `r`'s pieces):

    activate r's adapter  only its parameters are trainable (`lora.activate_adapter`), so the step's
                          gradients, clipping and optimizer update never touch another run's adapter
    train                 one optimizer step of r's optimizer/scheduler on r's batch
    checkpoint            r's adapter + optimizer + scheduler into r's folder (`trainable_only`)
    publish               r's adapter alone (PEFT files) as r's next weights version   <- commit
    log, ack, notify      r's event log, r's stream entry, r's orchestrator

So exactly-once and resume hold per run, with the single-run proofs (`checkpoint.plan_resume`):
every run resumes from its own folder. Runs are served round-robin: each turn asks every unfinished
run's stream for its next batch without waiting long (`BatchIntake.next(wait=False)`) and trains the
ones that have one, so a run whose orchestrator is slow never holds back the others. A run whose
`max_steps` is trained finishes on its own (its lock and notifier are released); the process exits
when every run has finished, unless `runs_dir` is set: then it keeps watching the folder for new
runs (a new `<name>.toml` joins at the next turn) until it is stopped.

One process only (the adapters are small; FSDP multi-run is not wired) and `loss.ref_kl_coef = 0`.
Randomness is shared: a run's checkpoint restores the global RNG, so runs are bit-exact on resume
only with `lora.dropout = 0` (the default), where training draws no random numbers.
"""

from __future__ import annotations

import logging
import threading
import time
import tomllib
import zlib
from pathlib import Path
from typing import Any

import torch
from gyre.config.loader import ConfigError, load_config
from gyre.config.trainer import RunConfig, TrainerConfig
from gyre.events import TRAINER_STEPS, EventLog, events_dir, read_events
from gyre.net import bind_or_explain
from gyre.runlock import LockHeld, RunLock
from gyre.transport import open_store
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from gyre_trainer import dist
from gyre_trainer.checkpoint import CheckpointError, CheckpointManager, plan_resume
from gyre_trainer.intake import BatchIntake, IntakeItem
from gyre_trainer.metrics import TrainerMetrics, serve
from gyre_trainer.publish import WeightPublisher, WeightsNotifier
from gyre_trainer.server import TrainerServer, TrainerStatus
from gyre_trainer.service import NodeHealth, crash_point, step_record

log = logging.getLogger(__name__)

RUNS_SCAN_S = 2.0  # how often `runs_dir` is looked at
POLL_MS = 100  # one run's stream read blocks at most this long per turn


class Run:
    """One run's pieces (everything but the shared model); built by `MultiRunTrainer.add_run`."""

    def __init__(self, spec: RunConfig, cfg: TrainerConfig, ctx: dist.DistContext, registry: CollectorRegistry):
        self.spec, self.name = spec, spec.name
        self.lora = spec.lora or cfg.lora
        self.optim = spec.optim or cfg.optim
        self.out = Path(spec.output_dir)
        self.lock = RunLock(self.out, "trainer").acquire()  # one trainer per run folder, as for a single run
        self.transport = open_store(cfg.weights, self.out)
        self.publisher = WeightPublisher(self.transport, cfg.model.name, cfg.weights_keep_last)
        self.checkpoints = CheckpointManager(
            self.out / "checkpoints" / "trainer", ctx, cfg.ckpt.keep_last, cfg.ckpt.keep_interval
        )
        self.events = EventLog(events_dir(self.out) / TRAINER_STEPS)
        self.metrics = TrainerMetrics(self.name, registry)
        o = spec.orchestrator
        self.notifier = WeightsNotifier(  # the trainer's control token unless the run names its own
            o.address, timeout_s=o.timeout_s, control_token=o.control_token or cfg.orchestrator.control_token,
            retry_initial_s=o.retry_initial_s, retry_max_s=o.retry_max_s,
        )  # fmt: skip
        self.optimizer = self.scheduler = self.intake = None
        self.rejected_seen = 0
        self.closed = False

    @property
    def trained_step(self) -> int:
        return self.intake.trained_step

    @property
    def finished(self) -> bool:
        return self.spec.max_steps is not None and self.trained_step >= self.spec.max_steps

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.notifier.close(timeout=2.0)
        self.events.close()
        self.lock.release()


class MultiRunTrainer:
    """The trainer process of `trainer.runs` / `trainer.runs_dir` (see the module docstring)."""

    def __init__(self, cfg: TrainerConfig, ctx: dist.DistContext):
        if ctx.world_size != 1:
            raise ValueError(f"runs: multi-run trains in one process, this trainer has {ctx.world_size} ranks")
        self.cfg, self.ctx = cfg, ctx
        self.stop_requested = threading.Event()
        self.runs: dict[str, Run] = {}
        self.registry = CollectorRegistry()
        self.status = TrainerStatus(world_size=1)
        self.model = None
        self.health: NodeHealth | None = None
        self.server: TrainerServer | None = None
        self.metrics_server = None
        self.metrics_port: int | None = None
        self.grpc_port: int | None = None
        self._redis = None
        self._bad_files: dict[Path, float] = {}  # runs_dir files that failed to load -> their mtime
        self._last_scan = float("-inf")

    # ---- lifecycle ------------------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        try:
            if cfg.server.health_port is not None:
                self.health = NodeHealth(cfg.server.host, cfg.server.health_port)
            self.metrics_server, self.metrics_port = bind_or_explain(
                lambda: serve(_Registry(self.registry), cfg.metrics.port, cfg.server.host),
                "trainer", "metrics.port", cfg.metrics.port,
            )  # fmt: skip
            self.server = TrainerServer(self.status, cfg.server.host, cfg.server.port)
            self.grpc_port = bind_or_explain(self.server.start, "trainer", "server.port", cfg.server.port)
            self._build()
            for spec in cfg.runs:
                self.add_run(spec)
            self.server.set_serving(True)
            if self.health:
                self.health.ready.set()
            self._loop()
            return 0
        finally:
            self._close()

    def _build(self) -> None:
        from gyre_trainer.model import load_model, resolve_dtype
        from gyre_trainer.perf import peak_flops

        cfg = self.cfg
        dist.seed_everything(cfg.seed, cfg.deterministic)
        self.dtype = resolve_dtype(cfg.model.dtype, self.ctx.device)
        self.model = load_model(
            cfg.model, self.ctx.device, self.dtype, activation_checkpointing=cfg.activation_checkpointing
        )
        self.hf_config = self.model.config
        self.peak_flops = peak_flops(self.ctx.device, self.dtype)

    def _close(self) -> None:
        for run in self.runs.values():
            run.close()
        if self.health:
            self.health.close()
        if self.server:
            self.server.stop(grace=1.0)
        if self.metrics_server:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()

    # ---- runs -----------------------------------------------------------------------------------
    def add_run(self, spec: RunConfig) -> Run:
        """Give `spec` its adapter, optimizer and schedule, resume it from its folder, open its stream."""
        from gyre_trainer.lora import activate_adapter, add_adapter
        from gyre_trainer.optim import build_optimizer, build_scheduler

        if spec.name in self.runs:
            raise ValueError(f"run {spec.name!r} is already trained by this trainer")
        run = Run(spec, self.cfg, self.ctx, self.registry)
        added = False
        try:
            # the adapter's initial values depend on (seed, run name) only, not on the runs added before it
            torch.manual_seed(self.cfg.seed * 1_000_003 + zlib.crc32(run.name.encode()))
            self.model = add_adapter(self.model, run.name, run.lora)
            added = True
            activate_adapter(self.model, run.name)
            run.optimizer = build_optimizer(self.model, run.optim)
            run.scheduler = build_scheduler(run.optimizer, run.optim, spec.max_steps)
            trained = self._resume(run)
            run.intake = BatchIntake(
                self.ctx, self._stream(run.name), trained, vocab_size=self.hf_config.vocab_size,
                poll_ms=min(POLL_MS, self.cfg.intake.poll_ms), should_stop=self.stop_requested.is_set,
            )  # fmt: skip
        except BaseException:
            run.close()
            if added and hasattr(self.model, "delete_adapter"):  # a fixed file can add the run again
                remaining = [n for n in self.model.peft_config if n != run.name]
                if remaining:
                    self.model.delete_adapter(run.name)
                    activate_adapter(self.model, remaining[0])
            raise
        self.runs[run.name] = run
        log.info("run %s joined at step %d (output %s)", run.name, trained, run.out)
        return run

    def _stream(self, name: str):
        import redis
        from gyre.streams import BatchStream

        if self._redis is None:
            self._redis = redis.Redis.from_url(self.cfg.redis.url, socket_timeout=30, socket_connect_timeout=5)
        return BatchStream(self._redis, name)

    def _resume(self, run: Run) -> int:
        """The single-run resume (`Trainer._resume`) on the run's own folder; returns its trained step."""
        from safetensors.torch import load_file

        from gyre_trainer.lora import ADAPTER_FILE

        resume_step = run.spec.resume_step if run.spec.resume_step is not None else self.cfg.ckpt.resume_step
        plan = plan_resume(resume_step, run.checkpoints.steps(), run.transport.latest())
        if plan.discard_after is not None:
            dropped = run.checkpoints.discard_after(plan.discard_after), run.publisher.discard_after(plan.discard_after)
            log.warning("run %s: rewinding to step %d: discarded checkpoints %s and weights %s",
                        run.name, plan.discard_after, *dropped)  # fmt: skip
        if plan.checkpoint_step is not None:
            run.checkpoints.load(plan.checkpoint_step, self.model, run.optimizer, run.scheduler)
        if plan.weights_step is not None:  # newer than the checkpoint: the adapter from its published files
            from peft import set_peft_model_state_dict

            tensors = load_file(run.transport.store.path(plan.weights_step) / ADAPTER_FILE)
            set_peft_model_state_dict(self.model, tensors, adapter_name=run.name)
            for _ in range(plan.weights_step - (plan.checkpoint_step or 0)):
                run.scheduler.step()
            log.warning("run %s: adapter restored from published step %d, optimizer state from %s (not bit-exact)",
                        run.name, plan.weights_step, plan.checkpoint_step or "scratch")  # fmt: skip
        if plan.republish:
            record = run.checkpoints.read_record(plan.trained_step) or {"step": plan.trained_step}
            self._publish(run, plan.trained_step, record)
        if plan.trained_step > 0:
            self._log_if_missing(run, plan.trained_step)
            if not plan.republish:
                run.notifier.notify(run.transport.version(plan.trained_step))
        run.metrics.step.set(plan.trained_step)
        return plan.trained_step

    def _log_if_missing(self, run: Run, step: int) -> None:
        if any(r.get("step") == step for r in read_events(run.events.path)):
            return
        record = run.publisher.read_record(step) or run.checkpoints.read_record(step)
        if record is not None:
            run.events.append(record)

    def scan_runs_dir(self) -> list[Run]:
        """Add the runs of `runs_dir` this trainer does not have yet; a bad file is logged once and skipped."""
        folder = self.cfg.runs_dir
        if folder is None or not Path(folder).is_dir():
            return []
        added = []
        for file in sorted(Path(folder).glob("*.toml")):
            if file.stem in self.runs or self._bad_files.get(file) == file.stat().st_mtime:
                continue
            try:
                data = tomllib.loads(file.read_text())
                spec = load_config(RunConfig, [], **{"name": file.stem, **data.get("run", data)})
                if spec.name != file.stem:
                    raise ConfigError(f"config key 'name': {spec.name!r} differs from the file name {file.stem!r}")
                added.append(self.add_run(spec))
            except (OSError, tomllib.TOMLDecodeError, ValidationError, ValueError, LockHeld, CheckpointError) as e:
                self._bad_files[file] = file.stat().st_mtime
                log.error("runs_dir: cannot add the run in %s (fix the file to retry): %s", file, e)
        return added

    # ---- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self.stop_requested.is_set():
            if time.monotonic() - self._last_scan >= RUNS_SCAN_S:
                self._last_scan = time.monotonic()
                self.scan_runs_dir()
            active = [run for run in self.runs.values() if not run.finished]
            if not active:
                if self.cfg.runs_dir is None:
                    log.info("every run finished: %s", {n: r.trained_step for n, r in self.runs.items()})
                    return
                self.stop_requested.wait(POLL_MS / 1000)
                continue
            for run in active:
                item = run.intake.next(self.stop_requested.is_set, wait=False)
                if item is not None:
                    self._step(run, item)
                    if run.finished:
                        log.info("run %s finished: step %d = its max_steps", run.name, run.trained_step)
                        run.close()
                if self.stop_requested.is_set():
                    break
        log.info("stop requested: leaving after %s", {n: r.trained_step for n, r in self.runs.items()})

    def _step(self, run: Run, item: IntakeItem) -> None:
        from gyre_trainer.lora import activate_adapter
        from gyre_trainer.perf import MFUMeter, effective_seq_len, flops_per_token
        from gyre_trainer.step import train_step

        cfg = self.cfg
        activate_adapter(self.model, run.name)
        start = time.perf_counter()
        result = train_step(
            self.model, run.optimizer, run.scheduler, item.batch, loss_cfg=cfg.loss,
            micro_batch_size=cfg.data.micro_batch_size, max_grad_norm=run.optim.max_grad_norm,
        )  # fmt: skip
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        seconds = time.perf_counter() - start
        lengths = [int(n) for mb in item.batch.for_rank(0) for n in mb.sample_lengths]
        mfu = MFUMeter(flops_per_token(self.hf_config, effective_seq_len(lengths)), self.peak_flops)
        mfu = mfu.reading(sum(lengths), seconds).mfu
        record = {**step_record(item, result.metrics, seconds, mfu), "run": run.name}
        crash_point("after_train", item.step, self.ctx)
        if cfg.ckpt.interval and item.step % cfg.ckpt.interval == 0:
            started = time.perf_counter()
            run.checkpoints.save(item.step, self.model, run.optimizer, run.scheduler, record)
            run.metrics.checkpoint_duration.observe(time.perf_counter() - started)
            crash_point("after_checkpoint", item.step, self.ctx)
        self._publish(run, item.step, record)
        run.events.append(record)
        run.metrics.observe_step(record, [mfu])
        run.metrics.rejected.inc(run.intake.rejected - run.rejected_seen)
        run.rejected_seen = run.intake.rejected
        self.status.update(item.step, record["num_tokens"])
        crash_point("after_log", item.step, self.ctx)
        run.intake.commit(item)
        crash_point("after_ack", item.step, self.ctx)
        run.publisher.prune()

    def _publish(self, run: Run, step: int, record: dict[str, Any]) -> None:
        """Run `run`'s adapter alone as its weights version `step` (the commit point), then notify."""
        from gyre_trainer.lora import named_adapter_state

        start = time.perf_counter()
        published = run.publisher.publish_adapter(step, named_adapter_state(self.model, run.name), run.lora, record)
        run.metrics.publish_duration.observe(time.perf_counter() - start)
        crash_point("after_publish", step, self.ctx)
        run.notifier.notify(published)


class _Registry:
    """What `metrics.serve` reads (`.registry`): the registry every run's metrics share (label run_id)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
