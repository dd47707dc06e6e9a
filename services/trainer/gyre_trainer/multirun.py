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
`max_steps` is trained finishes on its own and is released (`MultiRunTrainer.release`: its adapter's
parameters leave the model, its optimizer, schedule, stream reader, metric series, lock and notifier
go), so a long-lived trainer holds only the runs it trains. The process exits when every run has
finished, unless `runs_dir` is set: then it follows the folder until it is stopped: a new `<name>.toml`
joins at the next turn, a removed one stops its run after its current step (released the same way;
every trained step is committed, so the file put back resumes the run where it stopped), and a
finished run's file is left alone until it changes (a larger `max_steps` resumes it).

One process only (the adapters are small; FSDP multi-run is not wired). The KL term's reference
(`loss.ref_kl_coef`) is the shared base: the model with every adapter off (`lora.AdaptersOff`).
Randomness is shared: a run's checkpoint restores the global RNG, so runs are bit-exact on resume
only with `lora.dropout = 0` (the default), where training draws no random numbers.
"""

from __future__ import annotations

import functools
import logging
import time
import tomllib
import zlib
from pathlib import Path
from typing import Any

import torch
from gyre.config.loader import ConfigError, load_config
from gyre.config.trainer import RunConfig, TrainerConfig
from gyre.events import TRAINER_STEPS, EventLog, events_dir
from gyre.runlock import LockHeld, RunLock
from gyre.transport import open_store
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from gyre_trainer import dist
from gyre_trainer.checkpoint import CheckpointError, CheckpointManager
from gyre_trainer.intake import BatchIntake, IntakeItem
from gyre_trainer.metrics import TrainerMetrics
from gyre_trainer.publish import WeightPublisher
from gyre_trainer.service import TrainerProcess, crash_point, resume, step_record, weights_notifier

log = logging.getLogger(__name__)

RUNS_SCAN_S = 2.0  # how often `runs_dir` is looked at
POLL_MS = 100  # one run's stream read blocks at most this long per turn


class Run:
    """One run's pieces (everything but the shared model); built by `MultiRunTrainer.add_run`."""

    def __init__(
        self, spec: RunConfig, cfg: TrainerConfig, ctx: dist.DistContext, registry: CollectorRegistry,
        file: Path | None = None,
    ):  # fmt: skip
        self.spec, self.name = spec, spec.name
        self.file = file  # the runs_dir file it came from (None: `trainer.runs`)
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
        token = spec.orchestrator.control_token or cfg.orchestrator.control_token  # the trainer's unless its own
        self.notifier = weights_notifier(spec.orchestrator, token)
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
        """Release what the run holds besides the model's adapter: optimizer, schedule, stream reader,
        metric series, notifier, event log, lock. Its folder keeps its state."""
        if self.closed:
            return
        self.closed = True
        self.optimizer = self.scheduler = self.intake = None
        self.metrics.forget()
        self.notifier.close(timeout=2.0)
        self.events.close()
        self.lock.release()


class MultiRunTrainer(TrainerProcess):
    """The trainer process of `trainer.runs` / `trainer.runs_dir` (see the module docstring)."""

    def __init__(self, cfg: TrainerConfig, ctx: dist.DistContext):
        if ctx.world_size != 1:
            raise ValueError(f"runs: multi-run trains in one process, this trainer has {ctx.world_size} ranks")
        super().__init__(cfg, ctx)
        self.runs: dict[str, Run] = {}  # the runs being trained (a finished run is released and leaves)
        self.registry = CollectorRegistry()
        self.metrics = _Registry(self.registry)  # what `metrics.serve` reads
        self.model = None
        self._redis = None
        self._bad_files: dict[Path, float] = {}  # runs_dir files that failed to load -> their mtime
        self._done_files: dict[str, float] = {}  # finished runs' runs_dir files -> their mtime then
        self._last_scan = float("-inf")

    # ---- lifecycle ------------------------------------------------------------------------------
    def _prepare(self) -> None:
        self._build()
        for spec in self.cfg.runs:
            self.add_run(spec)

    def _build(self) -> None:
        """The shared base model; each run's adapter is added by `add_run`."""
        self.model = self._load_base_model()

    def _close(self) -> None:
        for run in self.runs.values():
            run.close()
        super()._close()

    # ---- runs -----------------------------------------------------------------------------------
    def add_run(self, spec: RunConfig, file: Path | None = None) -> Run:
        """Give `spec` its adapter, optimizer and schedule, resume it from its folder, open its stream."""
        from gyre_trainer.lora import activate_adapter, add_adapter
        from gyre_trainer.optim import build_optimizer, build_scheduler

        if spec.name in self.runs:
            raise ValueError(f"run {spec.name!r} is already trained by this trainer")
        run = Run(spec, self.cfg, self.ctx, self.registry, file)
        try:
            # the adapter's initial values depend on (seed, run name) only, not on the runs added before it
            torch.manual_seed(self.cfg.seed * 1_000_003 + zlib.crc32(run.name.encode()))
            self.model = add_adapter(self.model, run.name, run.lora)
            activate_adapter(self.model, run.name)
            run.optimizer = build_optimizer(self.model, run.optim, run.lora.lr_ratio_b)
            run.scheduler = build_scheduler(run.optimizer, run.optim, spec.max_steps)
            trained = self._resume(run)
            run.intake = BatchIntake(
                self.ctx, self._stream(run.name), trained, vocab_size=self.hf_config.vocab_size,
                poll_ms=min(POLL_MS, self.cfg.intake.poll_ms), should_stop=self.stop_requested.is_set,
            )  # fmt: skip
        except BaseException:
            run.close()
            self._drop_adapter(run.name)  # a fixed file can add the run again
            raise
        self.runs[run.name] = run
        self.status.resumed(run.name, trained)
        log.info("run %s joined at step %d (output %s)", run.name, trained, run.out)
        return run

    def release(self, run: Run, why: str) -> None:
        """`run` leaves this trainer: its adapter's parameters (and with them their gradients), optimizer,
        schedule, stream reader, metric series, lock and notifier are dropped, so a long-lived trainer
        holds only the runs it trains. Every trained step is committed in the run's folder, so adding
        it again resumes after its last step (a finished run trains nothing more)."""
        step = run.trained_step
        run.close()
        self._drop_adapter(run.name)
        del self.runs[run.name]
        if run.file is not None and why == "finished":
            self._done_files[run.name] = _mtime(run.file)
        self.status.finished(run.name)
        log.info("run %s %s at step %d: its adapter, optimizer and stream are released", run.name, why, step)

    def _drop_adapter(self, name: str) -> None:
        """Remove adapter `name` and its parameters from the model; with the last one, the plain base
        model comes back (the next run wraps it again)."""
        from gyre_trainer.lora import activate_adapter

        adapters = getattr(self.model, "peft_config", {})
        if name not in adapters:
            return
        remaining = [n for n in adapters if n != name]
        if remaining:
            self.model.delete_adapter(name)
            activate_adapter(self.model, remaining[0])
        else:
            self.model = self.model.unload()

    def _stream(self, name: str):
        import redis
        from gyre.streams import BatchStream

        if self._redis is None:
            self._redis = redis.Redis.from_url(self.cfg.redis.url, socket_timeout=30, socket_connect_timeout=5)
        return BatchStream(self._redis, name)

    def _resume(self, run: Run) -> int:
        """The single-run resume on the run's own folder and adapter; returns its trained step."""
        resume_step = run.spec.resume_step if run.spec.resume_step is not None else self.cfg.ckpt.resume_step
        publish = functools.partial(self._publish, run)
        plan = resume(run, self.model, self.ctx, resume_step, run.lora, publish, run.name, f"run {run.name}: ")
        return plan.trained_step

    def scan_runs_dir(self) -> list[Run]:
        """Follow `runs_dir`: add the runs of new files (a bad file is logged once and skipped until it
        changes), stop the runs whose file was removed. A finished run's file is skipped until it changes
        (e.g. a larger max_steps: the run resumes after its last step)."""
        folder = self.cfg.runs_dir
        if folder is None or not Path(folder).is_dir():
            return []
        files = {file.stem: file for file in sorted(Path(folder).glob("*.toml"))}
        for run in [r for r in self.runs.values() if r.file is not None and r.name not in files]:
            self.release(run, "stopped (its runs_dir file was removed)")
        self._done_files = {name: t for name, t in self._done_files.items() if name in files}
        added = []
        for name, file in files.items():
            mtime = _mtime(file)
            if name in self.runs or mtime in (self._bad_files.get(file), self._done_files.get(name)):
                continue
            try:
                data = tomllib.loads(file.read_text())
                spec = load_config(RunConfig, [], **{"name": name, **data.get("run", data)})
                if spec.name != name:
                    raise ConfigError(f"config key 'name': {spec.name!r} differs from the file name {name!r}")
                added.append(self.add_run(spec, file))
            except (OSError, tomllib.TOMLDecodeError, ValidationError, ValueError, LockHeld, CheckpointError) as e:
                self._bad_files[file] = mtime
                log.error("runs_dir: cannot add the run in %s (fix the file to retry): %s", file, e)
        return added

    # ---- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self.stop_requested.is_set():
            if not self.turn():
                log.info("every run finished")
                return
        log.info("stop requested: leaving after %s", {n: r.trained_step for n, r in self.runs.items()})

    def turn(self) -> bool:
        """One turn: follow `runs_dir` (every RUNS_SCAN_S), release finished runs, train every run whose
        next batch is there. False once nothing is left to do (no run left and no runs_dir to follow)."""
        if time.monotonic() - self._last_scan >= RUNS_SCAN_S:
            self._last_scan = time.monotonic()
            self.scan_runs_dir()
        for run in [r for r in self.runs.values() if r.finished]:  # e.g. resumed at its max_steps
            self.release(run, "finished")
        if not self.runs:
            if self.cfg.runs_dir is None:
                return False
            self.stop_requested.wait(POLL_MS / 1000)
        for run in list(self.runs.values()):
            item = run.intake.next(self.stop_requested.is_set, wait=False)
            if item is not None:
                self._step(run, item)
                if run.finished:
                    self.release(run, "finished")
            if self.stop_requested.is_set():
                break
        return True

    def _step(self, run: Run, item: IntakeItem) -> None:
        from gyre_trainer.lora import AdaptersOff, activate_adapter
        from gyre_trainer.perf import MFUMeter, effective_seq_len, flops_per_token
        from gyre_trainer.step import train_step

        cfg = self.cfg
        activate_adapter(self.model, run.name)
        start = time.perf_counter()
        result = train_step(
            self.model, run.optimizer, run.scheduler, item.batch, loss_cfg=cfg.loss,
            micro_batch_size=cfg.data.micro_batch_size, max_grad_norm=run.optim.max_grad_norm,
            ref_model=AdaptersOff(self.model) if cfg.loss.ref_kl_coef > 0 else None,  # every run's base: the same
        )  # fmt: skip
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        seconds = time.perf_counter() - start
        lengths = [int(n) for mb in item.batch.for_rank(0) for n in mb.sample_lengths]
        mfu = MFUMeter(flops_per_token(self.hf_config, effective_seq_len(lengths)), self.peak_flops)
        mfu = mfu.reading(sum(lengths), seconds).mfu
        record = {**step_record(item, result.metrics, seconds, mfu), "run": run.name}
        crash_point("after_train", item.step, self.ctx)
        self._checkpoint_if_due(item.step, run.checkpoints, run.optimizer, run.scheduler, record, run.metrics)
        self._publish(run, item.step, record)
        run.events.append(record)
        run.metrics.observe_step(record, [mfu])
        run.metrics.rejected.inc(run.intake.rejected - run.rejected_seen)
        run.rejected_seen = run.intake.rejected
        self.status.update(item.step, record["num_tokens"], run.name)
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


def _mtime(file: Path) -> float | None:
    try:
        return file.stat().st_mtime
    except OSError:  # removed meanwhile
        return None


class _Registry:
    """What `metrics.serve` reads (`.registry`): the registry every run's metrics share (label run_id)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
