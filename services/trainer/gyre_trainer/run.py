"""One run of a trainer, in one home: its pieces, its resume, and the ordered commit of every step.

A `RunState` is everything one run has besides the model it trains: weight transport and publisher,
checkpoints, event log, W&B run, metrics, orchestrator notifier, lock, optimizer and schedule, and its
intake (batch stream `gyre:{name}:batches`, read with the Redis client of the config). A single-run
trainer holds one (`gyre_trainer.service.Trainer`), a multi-run trainer N, one per LoRA adapter on a
shared base model (`gyre_trainer.multirun.MultiRunTrainer`). Both commit a step with `commit`, in this
order (the order is what makes every step train exactly once; `gyre_trainer.checkpoint.plan_resume`
has the crash analysis), with a crash point (`process.crash_point`) after each part (and inside the
optimizer step and the checkpoint and publish writes: `mid_step`, `mid_checkpoint`, `mid_publish`):

    1. train        one optimizer step on the batch (a multi-run run: its adapter alone is trainable)
    2. checkpoint   when step % ckpt.interval == 0: model, optimizer, scheduler, RNG, progress (atomic)
    3. publish      weights (or the adapter) as version `step`, atomically             <- commit point
    4. log          events/trainer_steps.jsonl, W&B, metrics, gRPC status
    5. ack          the stream entry of the batch
    6. prune        weight versions nobody needs any more
    (notify         NotifyWeights(step) from a background thread, queued right after the publish)

A graceful stop checkpoints the last committed step unless it has its checkpoint (`checkpoint_on_stop`).

`resume` is the other half: a starting run reconstructs its last committed step from its own folder.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from gyre.config.loader import reveal
from gyre.config.trainer import LoraConfig, OptimConfig, RunConfig, TrainerConfig
from gyre.events import TRAINER_STEPS, EventLog, events_dir, read_events
from gyre.runlock import RunLock
from gyre.runstate import ORCHESTRATOR_PROGRESS, mark_rewound, orchestrator_progress, pending_rewind
from gyre.transport import open_source, open_store
from gyre.wandb_log import WandbLogger

from gyre_trainer import dist
from gyre_trainer.checkpoint import CheckpointError, CheckpointManager, ResumePlan, partial_saves, plan_resume
from gyre_trainer.debug import StepDebugger
from gyre_trainer.intake import BatchIntake, IntakeItem
from gyre_trainer.metrics import TrainerMetrics
from gyre_trainer.process import crash_in_optimizer_step, crash_point
from gyre_trainer.publish import RESUME_ADAPTER, WEIGHTS_FILE, WeightPublisher, WeightsNotifier

if TYPE_CHECKING:
    from gyre_trainer.process import TrainerProcess

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSpec:
    """What makes a run itself: its name, folder, length, orchestrator, optimizer, adapter and resume point."""

    name: str
    output_dir: Path
    max_steps: int | None
    orchestrator: Any  # address, timeout and retries of its NotifyWeights (trainer.orchestrator, or a run's own)
    control_token: str | None
    optim: OptimConfig
    lora: LoraConfig | None
    resume_step: int | None
    adapter: str | None = None  # multi-run: the run's named adapter on the shared base model
    file: Path | None = None  # multi-run: the runs_dir file it came from

    @classmethod
    def of_trainer(cls, cfg: TrainerConfig) -> RunSpec:
        """A single-run trainer's one run: the trainer's own keys."""
        token = reveal(cfg.orchestrator.control_token)
        return cls(cfg.run_id, Path(cfg.output_dir), cfg.max_steps, cfg.orchestrator, token, cfg.optim, cfg.lora,
                   cfg.ckpt.resume_step)  # fmt: skip

    @classmethod
    def of_run(cls, run: RunConfig, cfg: TrainerConfig, file: Path | None = None) -> RunSpec:
        """A multi-run run: its own keys, the trainer's where it has none."""
        token = reveal(run.orchestrator.control_token or cfg.orchestrator.control_token)  # the trainer's unless its own
        resume_step = run.resume_step if run.resume_step is not None else cfg.ckpt.resume_step
        return cls(run.name, Path(run.output_dir), run.max_steps, run.orchestrator, token, run.optim or cfg.optim,
                   run.lora or cfg.lora, resume_step, adapter=run.name, file=file)  # fmt: skip


class RunState:
    """One run's pieces and its ordered `commit` (see the module docstring); `process` holds the model."""

    def __init__(self, spec: RunSpec, process: TrainerProcess):
        self.spec, self.name, self.process = spec, spec.name, process
        cfg, ctx = process.cfg, process.ctx
        self.out = spec.output_dir
        self.transport = open_store(cfg.weights, self.out)
        self.source = open_source(cfg.weights)  # how a resume reads a published version back
        self.publisher = WeightPublisher(self.transport, cfg.model.name, cfg.weights_keep_last)
        self.checkpoints = CheckpointManager(self.out / "checkpoints" / "trainer", ctx, cfg.ckpt.keep_last,
                                             cfg.ckpt.keep_interval)  # fmt: skip
        self.metrics = TrainerMetrics(self.name, process.registry)
        self.optimizer = self.scheduler = None
        self.intake: BatchIntake | None = None
        self.lock: RunLock | None = None
        self.events: EventLog | None = None
        self.wandb: WandbLogger | None = None
        self.notifier: WeightsNotifier | None = None
        self.rejected_seen = 0
        self.debugger: StepDebugger | None = None  # made at the first step: it needs the loaded model's config
        self.grad_norm_history: list[float] | None = None  # the spike detector's, from the checkpoint resumed
        self.checkpointed_step: int | None = None  # the newest step this process saved or loaded a checkpoint of
        self.last_commit: tuple[int, dict[str, Any]] | None = None  # (step, record) this process committed last
        self.closed = False

    # ---- lifecycle ------------------------------------------------------------------------------
    def open(self) -> RunState:
        """Rank 0 takes the run's folder (one trainer per folder: a second fails at once, naming the holder)
        and opens its event log, W&B run and orchestrator notifier."""
        if not self.process.ctx.is_main:
            return self
        cfg = self.process.cfg
        self.lock = RunLock(self.out, "trainer").acquire()
        try:
            self.events = EventLog(events_dir(self.out) / TRAINER_STEPS)
            self.wandb = WandbLogger(cfg.wandb, service="trainer", run_id=self.name, output_dir=self.out,
                                     config=cfg)  # fmt: skip
            self.notifier = weights_notifier(self.spec.orchestrator, self.spec.control_token)
        except BaseException:
            self.close()
            raise
        return self

    def build_optimizer(self, model: torch.nn.Module) -> None:
        """The run's optimizer (over the model's trainable parameters) and LR schedule."""
        from gyre_trainer.optim import build_optimizer, build_scheduler

        spec = self.spec
        self.optimizer = build_optimizer(model, spec.optim, spec.lora.lr_ratio_b if spec.lora else 1.0)
        self.scheduler = build_scheduler(self.optimizer, spec.optim, spec.max_steps)

    def open_intake(self, trained_step: int, poll_ms: int) -> BatchIntake:
        """The run's batches after `trained_step` (rank 0 reads the stream with the process's Redis client)."""
        from gyre.redis_retry import Stopped, call_with_retry
        from gyre.streams import BatchStream, claim_run_id

        process = self.process
        owner = process.cfg.redis.owner
        if owner and process.ctx.is_main:  # before reading: in the consumer group, another experiment's trainer and
            # this one would each take (and train, and ack) part of the other's batches
            with contextlib.suppress(Stopped):  # a stop during a Redis outage: the loop ends before any read
                call_with_retry(lambda: claim_run_id(process.redis(), self.name, owner), what="claiming the run id",
                                should_stop=process.stop_requested.is_set)  # fmt: skip
        stream = (BatchStream(process.redis(), self.name, dead_maxlen=process.cfg.intake.dead_letter_maxlen)
                  if process.ctx.is_main else None)  # fmt: skip
        self.intake = BatchIntake(process.ctx, stream, trained_step, vocab_size=process.hf_config.vocab_size,
                                  seq_len=process.cfg.data.seq_len, poll_ms=poll_ms,
                                  should_stop=process.stop_requested.is_set)  # fmt: skip
        process.status.resumed(self.name, trained_step)
        return self.intake

    @property
    def trained_step(self) -> int:
        return self.intake.trained_step

    @property
    def finished(self) -> bool:
        return self.spec.max_steps is not None and self.trained_step >= self.spec.max_steps

    def close(self) -> None:
        """Release what the run holds besides the model: optimizer, schedule, stream reader, metric series,
        notifier, event log, W&B run, lock. Its folder keeps its state."""
        if self.closed:
            return
        self.closed = True
        self.optimizer = self.scheduler = self.intake = None
        self.metrics.forget()
        if self.notifier:
            self.notifier.close(timeout=2.0)
        if self.events:
            self.events.close()
        if self.wandb:
            self.wandb.finish()
        if self.lock:
            self.lock.release()

    # ---- resume ---------------------------------------------------------------------------------
    def resume(self) -> ResumePlan:
        """Reconstruct the run's last committed step onto the model (rank 0 plans, every rank loads): drop what
        a rewind discards, load the checkpoint, then the newer published weights, republish a checkpoint newer
        than every version, and log and notify what a crash may have left undone."""
        spec, ctx, model = self.spec, self.process.ctx, self.process.model
        label = f"run {self.name}: " if spec.adapter else ""
        plan = rewind = None
        if ctx.is_main:
            rewind = pending_rewind(self.checkpoints.root, spec.resume_step)
            if rewind != spec.resume_step:
                log.info("%sckpt.resume_step = %d: rewound to it before (a restarted pod); resuming where the run "
                         "stands", label, spec.resume_step)  # fmt: skip
            progress = orchestrator_progress(self.out)
            if rewind and progress is not None and rewind not in progress:
                # before anything is deleted: the orchestrator refuses this rewind (it needs progress checkpoint N),
                # and a trainer rewound alone would wait for batches the orchestrator has pushed already
                raise CheckpointError(
                    f"ckpt.resume_step={rewind}: the orchestrator has no progress checkpoint of step {rewind} in "
                    f"{self.out / ORCHESTRATOR_PROGRESS} (have {progress}), so it cannot rewind with the trainer; "
                    "nothing was deleted"
                )
            plan = plan_resume(rewind, self.checkpoints.steps(), self.transport.latest())
            if plan.discard_after is not None:
                check_orchestrator_rewinds(self.out, rewind)
                dropped = (
                    self.checkpoints.discard_after(plan.discard_after),
                    self.publisher.discard_after(plan.discard_after),
                )
                log.warning("%srewinding to step %d: discarded checkpoints %s and weights %s", label,
                            plan.discard_after, *dropped)  # fmt: skip
            for folder in partial_saves(self.checkpoints.root, self.out / "weights"):
                # a save a crash cut short before its commit (rename): never listed, never loaded; say which, so
                # that a user who finds it knows the run did not resume from it (removed by the next save/prune)
                log.warning("%signoring %s: a save cut short by a crash before its commit, never loaded; resuming "
                            "from %s", label, folder, plan.source())  # fmt: skip
        plan = dist.broadcast_object(plan, ctx)
        if plan.checkpoint_step is not None:
            try:
                progress = self.checkpoints.load(plan.checkpoint_step, model, self.optimizer, self.scheduler)
            except CheckpointError as e:
                hint = without_checkpoint(self.checkpoints, plan.checkpoint_step, self.transport.latest())
                raise CheckpointError(f"{e}. {hint}") from None
            self.checkpointed_step = plan.checkpoint_step
            # a spike right after the resume is judged against the steps before it (absent: an older checkpoint)
            self.grad_norm_history = progress.get("grad_norm_history")
        if plan.weights_step is not None:
            fetched = self.source.fetch(self.transport.version(plan.weights_step))  # verified, as a replica does
            load_published(model, fetched.folder, plan, spec.lora, spec.adapter or "default")
            for _ in range(plan.weights_step - (plan.checkpoint_step or 0)):  # the schedule counts updates
                self.scheduler.step()
            log.warning("%sparameters restored from published weights step %d, optimizer state from %s: resumed "
                        "state is not bit-exact (set ckpt.interval=1 for exact resumes)", label, plan.weights_step,
                        f"checkpoint {plan.checkpoint_step}" if plan.checkpoint_step else "scratch")  # fmt: skip
        if plan.republish:  # the checkpoint is newer than every published version: commit it now
            self.publish(
                plan.trained_step, self.checkpoints.read_record(plan.trained_step) or {"step": plan.trained_step}
            )
        if ctx.is_main and rewind is not None and rewind >= 0:
            mark_rewound(self.checkpoints.root, rewind)  # done: a restart with the same resume_step goes on
        if ctx.is_main and plan.trained_step > 0:
            if log_if_missing(self.events, plan.trained_step, self.publisher, self.checkpoints):
                log.info("%slogged step %d from its published record (the previous run died before logging it)",
                         label, plan.trained_step)  # fmt: skip
            if not plan.republish:  # the previous run may have died before its notification went out
                self.notifier.notify(self.transport.version(plan.trained_step))
        self.metrics.step.set(plan.trained_step)
        log.info("%sresuming after step %d (%s)", label, plan.trained_step, plan)
        return plan

    # ---- one step -------------------------------------------------------------------------------
    def commit(self, item: IntakeItem) -> dict[str, Any]:
        """Train batch `item.step` and commit it: the ordered steps of the module docstring; returns its record.
        Meanwhile `process.step_running` is set: a stop signal then says it waits for this step."""
        self.process.step_running.set()
        try:
            return self._commit(item)
        finally:
            self.process.step_running.clear()

    def _commit(self, item: IntakeItem) -> dict[str, Any]:
        ctx, step = self.process.ctx, item.step
        record, mfu_per_rank = self.train(item)
        crash_point("after_train", step, ctx)
        self.checkpoint_if_due(step, record)
        self.publish(step, record)
        if ctx.is_main:
            self.events.append(record)
            self.wandb.log(record)
            self.metrics.observe_step(record, mfu_per_rank)
            self.metrics.rejected.inc(self.intake.rejected - self.rejected_seen)
            self.rejected_seen = self.intake.rejected
            self.process.status.update(step, record["num_tokens"], self.name)
            log_step(f"run {self.name}: " if self.spec.adapter else "", record)
            crash_point("after_log", step, ctx)
        self.intake.commit(item)
        self.last_commit = (step, record)
        crash_point("after_ack", step, ctx)
        if ctx.is_main:
            self.publisher.prune()
        return record

    def train(self, item: IntakeItem) -> tuple[dict[str, Any], list[float]]:
        """One timed optimizer step of this run; returns the step's event record and every rank's MFU."""
        from gyre_trainer.perf import MFUMeter, effective_seq_len, flops_per_token
        from gyre_trainer.step import train_step

        process, spec = self.process, self.spec
        cfg, ctx, model = process.cfg, process.ctx, process.model
        if spec.adapter is not None:  # the run's adapter alone is active and trainable
            from gyre_trainer.lora import activate_adapter

            activate_adapter(model, spec.adapter)
        if self.debugger is None:
            self.debugger = StepDebugger(cfg, ctx, process.hf_config, process.dtype, output_dir=self.out,
                                         lora=spec.lora, adapter=spec.adapter, on_bad_step=self._bad_step,
                                         history=self.grad_norm_history)  # fmt: skip
        start = time.perf_counter()
        with crash_in_optimizer_step(self.optimizer, item.step, ctx):
            result = train_step(model, self.optimizer, self.scheduler, item.batch, rank=ctx.rank,
                                world_size=ctx.world_size, loss_cfg=cfg.loss,
                                micro_batch_size=cfg.data.micro_batch_size, ref_model=process.ref_model,
                                max_grad_norm=spec.optim.max_grad_norm,
                                inspect_gradients=self.debugger.hook(item.step, item.batch, model))  # fmt: skip
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        seconds = time.perf_counter() - start
        lengths = [int(n) for mb in item.batch.for_rank(ctx.rank) for n in mb.sample_lengths]
        # LoRA: the frozen base gets no weight gradients (perf.flops_per_token); the run's adapter alone is trainable
        adapter = sum(p.numel() for p in model.parameters() if p.requires_grad) if spec.lora is not None else 0
        flops = flops_per_token(process.hf_config, effective_seq_len(lengths), adapter_params=adapter)
        meter = MFUMeter(flops, process.peak_flops)
        mfu_per_rank = [v[0] for v in dist.gather_floats([meter.reading(sum(lengths), seconds).mfu], ctx)]
        record = step_record(item, result.metrics, seconds, sum(mfu_per_rank) / len(mfu_per_rank))
        if spec.adapter is not None:
            record["run"] = self.name
        return record, mfu_per_rank

    def _bad_step(self, step: int, reason: str) -> None:
        if self.process.ctx.is_main:
            self.metrics.grad_norm_spikes.inc()

    def checkpoint_if_due(self, step: int, record: dict[str, Any]) -> None:
        """Step `step`'s checkpoint when `ckpt.interval` says so (before publishing: see `plan_resume`)."""
        interval = self.process.cfg.ckpt.interval
        if interval and step % interval == 0:
            self._save_checkpoint(step, record)
            crash_point("after_checkpoint", step, self.process.ctx)

    def checkpoint_on_stop(self) -> bool:
        """A graceful stop (SIGTERM/SIGINT; a multi-run run whose `runs_dir` file was removed): checkpoint the last
        step, which is committed (published, logged, acked), unless it has its checkpoint already, so that the restart
        resumes it exactly instead of from published weights with fresh optimizer moments (`ckpt.on_stop`). The same
        atomic save as an interval checkpoint: `plan_resume` finds checkpoint == newest weights, a plain resume. Every
        rank calls it and decides alike, from what this process trained and saved (never from the shared folder).
        True when it saved."""
        label = f"run {self.name}: " if self.spec.adapter else ""
        if self.last_commit is None or self.last_commit[0] != self.trained_step:
            return False  # nothing trained since the resume: the run's folder reconstructs this state as it is
        step, record = self.last_commit
        if self.checkpointed_step == step:
            log.info("%sstopping: step %d has its checkpoint already", label, step)
            return False
        if not self.process.cfg.ckpt.on_stop:
            log.info("%sstopping without a checkpoint of step %d (ckpt.on_stop = false): a restart resumes from %s",
                     label, step, f"checkpoint {self.checkpointed_step} and the published weights"
                     if self.checkpointed_step else "the published weights with fresh optimizer moments")  # fmt: skip
            return False
        log.info("%sstopping: checkpointing step %d first (ckpt.on_stop)", label, step)
        if self.spec.adapter is not None:  # multi-run: the checkpoint holds the active adapter's parameters
            from gyre_trainer.lora import activate_adapter

            activate_adapter(self.process.model, self.spec.adapter)
        self._save_checkpoint(step, record)
        return True

    def _save_checkpoint(self, step: int, record: dict[str, Any]) -> None:
        start = time.perf_counter()
        history = list(self.debugger.watch.history) if self.debugger else self.grad_norm_history
        self.checkpoints.save(step, self.process.model, self.optimizer, self.scheduler, record,
                              grad_norm_history=history,
                              dtype=str(self.process.dtype).removeprefix("torch."))  # fmt: skip
        self.metrics.checkpoint_duration.observe(time.perf_counter() - start)
        self.checkpointed_step = step

    def publish(self, step: int, record: dict[str, Any]) -> None:
        """Publish the run's weights as version `step` (every rank gathers, rank 0 writes), the commit point
        of a step: from here on a restarted trainer treats it as trained. Then queue the notification.

        What is published: the full weights; with `lora`, the merged weights with the adapter kept beside
        them, or (`lora.publish = "adapter"`, and always for a multi-run run) the adapter alone."""
        process, spec = self.process, self.spec
        ctx, lora, model = process.ctx, spec.lora, process.model
        start = time.perf_counter()
        if spec.adapter is not None:  # a named adapter of the shared base model (one process)
            from gyre_trainer.lora import named_adapter_state

            published = self.publisher.publish_adapter(step, named_adapter_state(model, spec.adapter), lora, record)
        else:
            adapter_only = lora is not None and lora.publish == "adapter"
            state_dict = dist.full_state_dict(model, ctx, trainable_only=adapter_only)
            if not ctx.is_main:
                return
            if adapter_only:
                published = self.publisher.publish_adapter(step, state_dict, lora, record)
            else:
                adapter = None
                if lora is not None:  # merged: every backend serves it like a full model; the adapter is kept too
                    from gyre_trainer.lora import adapter_state_dict, merged_state_dict

                    adapter = adapter_state_dict(state_dict)
                    state_dict = merged_state_dict(state_dict, lora)
                published = self.publisher.publish(
                    step, state_dict, process.hf_config, record, adapter=adapter, lora_cfg=lora
                )
        self.metrics.publish_duration.observe(time.perf_counter() - start)
        crash_point("after_publish", step, ctx)
        self.notifier.notify(published)


def without_checkpoint(checkpoints: CheckpointManager, step: int, latest_weights: int | None) -> str:
    """What to do about complete checkpoint `step` that does not load (damaged on the volume after its commit: a crash
    cannot cut it short): where the run resumes once it is moved away. Not done automatically: a damaged volume is
    worth a look, and a silent fallback would hide it."""
    fallback = plan_resume(None, [s for s in checkpoints.steps() if s < step], latest_weights)
    hint = (f"To resume without it, move {checkpoints.path(step)} out of {checkpoints.root}: the run then resumes "
            f"after step {fallback.trained_step} from {fallback.source()}")  # fmt: skip
    if fallback.trained_step < step:  # unpublished, hence unacked: their batches are still pending in the stream
        hint += f", training steps {fallback.trained_step + 1}..{step} again (their batches are still pending)"
    return hint


def check_orchestrator_rewinds(out: Path, rewind: int) -> None:
    """CheckpointError, before anything is deleted, when an orchestrator runs on this run folder (on this host) without
    asking for the same rewind (`gyre trainer --ckpt.resume-step N` started by hand beside a running `gyre
    orchestrator`): it resumed after the abandoned batches, and a trainer rewound alone waited for step N + 1
    forever."""
    from gyre.runlock import running_holder

    holder = running_holder(out, "orchestrator")
    if holder is not None and holder.get("resume_step") != rewind:
        raise CheckpointError(
            f"ckpt.resume_step={rewind}: an orchestrator (pid {holder.get('pid')}) is running on {out} without this "
            f"rewind (its resume_step: {holder.get('resume_step')}); rewound alone, the trainer would wait forever for "
            f"a batch it has already pushed. Stop it and start both with resume_step = {rewind} (gyre rl "
            "--ckpt.resume-step does); nothing was deleted"
        )


def log_step(label: str, record: dict[str, Any]) -> None:
    """One line per trained step, what an operator tailing the trainer's log (`kubectl logs`) asks first: is it
    learning, how fast. The full record is in events/trainer_steps.jsonl and on the metrics endpoint."""

    def num(key: str, spec: str = ".4g") -> str:
        value = record.get(key)
        return "n/a" if value is None else format(value, spec)

    seconds, tokens = record["step_seconds"], record["num_tokens"]
    # the objective's clip (or mask) fraction: with the KL, what a PPO user reads first (verl's pg_clipfrac)
    clipped = "masked" if "masked_frac" in record else "clip"
    log.info(
        "%sstep %d: loss %s, entropy %s, %s frac %s, mismatch KL %s, grad norm %s, lr %s%s, %d tokens in %.2fs "
        "(%.0f tok/s, MFU %s%%)",
        label, record["step"], num("loss"), num("entropy"), clipped, num(f"{clipped}_frac", ".3g"),
        num("mismatch_kl", ".3g"), num("grad_norm"), num("lr", ".3g"), " (update skipped)" if record.get("skipped")
        else "", tokens, seconds, tokens / seconds if seconds > 0 else 0.0, format(100 * record["mfu"], ".1f"),
        extra={"step": record["step"]},  # a field of its own in JSON logs (log.format), for a log query by step
    )  # fmt: skip


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
        # the step's training throughput, all ranks (PRIME-RL's and verl's perf/throughput): what a W&B chart wants,
        # which cannot divide two logged series
        "tokens_per_second": int(metrics.get("num_tokens", item.batch.num_tokens)) / seconds if seconds > 0 else 0.0,
        "mfu": mfu,
        "min_version": min(mins) if mins else None,
        "max_version": max(maxs) if maxs else None,
        "time": time.time(),
    }
    for key in ("num_loss_tokens", "num_valid_tokens"):
        if key in metrics:
            record[key] = int(metrics[key])
    # the objective's and the correction's stats (clip_frac, masked_frac, is_weight, ...; docs/algorithms.md)
    extras = ("is_weight", "ref_kl", "teacher_kl", "ratio_mean", "ratio_min", "ratio_max", "skipped", "skip_reason")
    record.update({k: v for k, v in metrics.items() if k.endswith("_frac") or k in extras})
    return record
