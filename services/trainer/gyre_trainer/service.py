"""The RL trainer of one run: batch `s` in, one optimizer step, weights `s` out, orchestrator notified.

`Trainer` is a `TrainerProcess` (servers, base model, lifecycle: `gyre_trainer.process`) holding one
`RunState` (`gyre_trainer.run`: the run's pieces and the ordered commit of a step): the model,
sharded over every rank with FSDP2, is the run's own. Per step, in this order (`RunState.commit`):

    1. batch s      rank 0 reads it from Redis (consumer group, strict order), all ranks get it
    2. train        one optimizer step (gyre_trainer.step.train_step) on this rank's micro batches
    3. checkpoint   when s % ckpt.interval == 0: model, optimizer, scheduler, RNG, progress (atomic)
                    (and of the last step on SIGTERM/SIGINT, `ckpt.on_stop`: `RunState.checkpoint_on_stop`)
    4. publish      full state dict gathered on rank 0, weights/step_s written atomically  <- commit
    5. log          one line in events/trainer_steps.jsonl, W&B, metrics, gRPC status
    6. ack          the Redis entry of batch s
    7. notify       Orchestrator/NotifyWeights(s) from a background thread (never blocks, never raises)

On start the trainer resumes from the run's own durable state (checkpoints and published weights)
and re-logs / re-publishes whatever a crash left half done, then continues with batch `s + 1`
(`RunState.resume`; `gyre_trainer.checkpoint.plan_resume` has the crash analysis). Several runs on one
base model, one LoRA adapter each: `gyre_trainer.multirun`.
"""

from __future__ import annotations

import logging
from typing import Any

from gyre.config.trainer import TrainerConfig

from gyre_trainer import dist
from gyre_trainer.checkpoint import ResumePlan
from gyre_trainer.process import TrainerProcess
from gyre_trainer.run import RunSpec, RunState
from gyre_trainer.stopping import StopSignals

log = logging.getLogger(__name__)


class Trainer(TrainerProcess):
    """One trainer process (one rank) of a single run: the model, its reference and the run's `RunState`."""

    def __init__(self, cfg: TrainerConfig, ctx: dist.DistContext):
        super().__init__(cfg, ctx)
        self.run_state = RunState(RunSpec.of_trainer(cfg), self)
        self._ref_model = None

    @property
    def ref_model(self) -> Any:
        return self._ref_model

    # ---- lifecycle ------------------------------------------------------------------------------
    def _start_servers(self) -> None:
        self.run_state.open()  # the run's folder first: a second trainer on it fails before binding anything
        super()._start_servers()

    def _prepare(self) -> None:
        self._build()
        plan = self._resume()
        self.run_state.open_intake(plan.trained_step, self.cfg.intake.poll_ms)

    def _build(self) -> None:
        from gyre_trainer.model import load_model

        cfg, ctx = self.cfg, self.ctx
        model = self._load_base_model()
        if cfg.lora is not None:  # adapters only: the optimizer takes the trainable parameters
            from gyre_trainer.lora import apply_lora

            model = apply_lora(model, cfg.lora)
        self.model = dist.shard_model(model, ctx)
        self.run_state.build_optimizer(self.model)
        if cfg.loss.ref_kl_coef > 0 and cfg.lora is not None:  # the base is in the model: adapters off
            from gyre_trainer.lora import AdaptersOff

            self._ref_model = AdaptersOff(self.model)
        elif cfg.loss.ref_kl_coef > 0:  # frozen copy of the base model for the KL term
            ref = load_model(cfg.model, ctx.device, self.dtype).eval().requires_grad_(False)
            self._ref_model = dist.shard_model(ref, ctx)

    def _resume(self) -> ResumePlan:
        """Reconstruct the state of the last committed step (rank 0 plans, every rank loads)."""
        return self.run_state.resume()

    def _close(self) -> None:
        self.run_state.close()
        super()._close()

    # ---- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        run, max_steps = self.run_state, self.cfg.max_steps
        while max_steps is None or run.trained_step < max_steps:
            item = run.intake.next(self.stop_requested.is_set)
            if item is None:
                log.info("stop requested: leaving after step %d", run.trained_step)
                run.checkpoint_on_stop()  # every rank got None together: the save is collective
                return
            run.commit(item)
        log.info("reached max_steps=%d", max_steps)


def run(cfg: TrainerConfig, *, handle_signals: bool = True) -> int:
    """Run the trainer until `max_steps` or SIGTERM/SIGINT (which finish the current step and checkpoint it first;
    a second Ctrl-C of a single process raises KeyboardInterrupt at once).

    `handle_signals=False` leaves the process's signal handlers alone (a trainer embedded in a test).
    """
    ctx = dist.init_distributed(cfg.device)
    if cfg.runs or cfg.runs_dir:  # one LoRA adapter per run on one base model (gyre_trainer.multirun)
        from gyre_trainer.multirun import MultiRunTrainer

        trainer = MultiRunTrainer(cfg, ctx)
    else:
        trainer = Trainer(cfg, ctx)

    def not_ready() -> None:
        if trainer.health:
            trainer.health.ready.clear()

    # A second Ctrl-C of a single process stops at once (a KeyboardInterrupt, exit 130): the unfinished step's
    # Redis entry is not acked, so the restart trains it again, once.
    signals = StopSignals(trainer.stop_requested, log, not_ready, trainer.step_running.is_set)
    if handle_signals:
        signals.install()
    try:
        status = trainer.run()
        # Ranks leave together, as SFT's do: a rank that tore its process group down while rank 0 was still
        # publishing aborted at exit once (gloo: "terminate called without an active exception", SIGABRT).
        dist.barrier(ctx)
        return status
    except Exception as e:
        if signals.forced.is_set():  # a second Ctrl-C inside a checkpoint save: torch re-raises it as its own error
            raise KeyboardInterrupt from e
        raise
    finally:
        signals.restore()
        dist.shutdown(ctx)
