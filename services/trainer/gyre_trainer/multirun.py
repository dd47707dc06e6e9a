"""Multi-run: one trainer process trains N runs on one base model, one LoRA adapter per run.

Each run (`trainer.runs[]`, or a file in `trainer.runs_dir`) has everything a single-run trainer has
except the base model: its own peft adapter (named after the run), AdamW optimizer, LR schedule,
progress, batch stream `gyre:{name}:batches`, output folder (weights, checkpoints, events), lock and
orchestrator: a `RunState` (`gyre_trainer.run`), as the single-run trainer's one run. Per step of run `r`
(`RunState.commit`, the single-run order on `r`'s pieces):

    activate r's adapter  only its parameters are trainable (`lora.activate_adapter`), so the step's
                          gradients, clipping and optimizer update never touch another run's adapter
    train                 one optimizer step of r's optimizer/scheduler on r's batch
    checkpoint            r's adapter + optimizer + scheduler into r's folder (`trainable_only`)
    publish               r's adapter alone (PEFT files) as r's next weights version   <- commit
    log, ack, notify      r's event log and W&B run, r's stream entry, r's orchestrator

So exactly-once and resume hold per run, with the single-run proofs (`checkpoint.plan_resume`):
every run resumes from its own folder. Runs are served round-robin: each turn asks every unfinished
run's stream for its next batch without waiting long (`BatchIntake.next(wait=False)`) and trains the
ones that have one, so a run whose orchestrator is slow never holds back the others. A run whose
`max_steps` is trained finishes on its own and is released (`MultiRunTrainer.release`: its adapter's
parameters leave the model, its optimizer, schedule, stream reader, metric series, lock and notifier
go), so a long-lived trainer holds only the runs it trains. The process exits when every run has
finished, unless `runs_dir` is set: then it follows the folder until it is stopped: a new `<name>.toml`
joins at the next turn, a removed one stops its run after its current step (checkpointed, `ckpt.on_stop`, and
released the same way; every trained step is committed, so the file put back resumes the run where it stopped), and a
finished run's file is left alone until it changes (a larger `max_steps` resumes it).

One process only (the adapters are small; FSDP multi-run is not wired). The KL term's reference
(`loss.ref_kl_coef`) is the shared base: the model with every adapter off (`lora.AdaptersOff`).
Randomness is shared: a run's checkpoint restores the global RNG, so runs are bit-exact on resume
only with `lora.dropout = 0` (the default), where training draws no random numbers.
"""

from __future__ import annotations

import logging
import time
import tomllib
import zlib
from pathlib import Path
from typing import Any

import torch
from gyre.config import ConfigError, load_config
from gyre.config.trainer import RunConfig, TrainerConfig
from gyre.runlock import LockHeld
from pydantic import ValidationError

from gyre_trainer import dist
from gyre_trainer.checkpoint import CheckpointError
from gyre_trainer.process import TrainerProcess
from gyre_trainer.run import RunSpec, RunState

log = logging.getLogger(__name__)

RUNS_SCAN_S = 2.0  # how often `runs_dir` is looked at
POLL_MS = 100  # one run's stream read blocks at most this long per turn


class MultiRunTrainer(TrainerProcess):
    """The trainer process of `trainer.runs` / `trainer.runs_dir` (see the module docstring)."""

    def __init__(self, cfg: TrainerConfig, ctx: dist.DistContext):
        if ctx.world_size != 1:
            raise ValueError(f"runs: multi-run trains in one process, this trainer has {ctx.world_size} ranks")
        super().__init__(cfg, ctx)
        self.runs: dict[str, RunState] = {}  # the runs being trained (a finished run is released and leaves)
        self._bad_files: dict[Path, float] = {}  # runs_dir files that failed to load -> their mtime
        self._done_files: dict[str, float] = {}  # finished runs' runs_dir files -> their mtime then
        self._last_scan = float("-inf")

    @property
    def ref_model(self) -> Any:
        """Every run's KL reference is the same: the shared base, every adapter off."""
        if self.cfg.loss.ref_kl_coef <= 0:
            return None
        from gyre_trainer.lora import AdaptersOff

        return AdaptersOff(self.model)

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
    def add_run(self, spec: RunConfig, file: Path | None = None) -> RunState:
        """Give `spec` its adapter, optimizer and schedule, resume it from its folder, open its stream."""
        from gyre_trainer.lora import activate_adapter, add_adapter

        if spec.name in self.runs:
            raise ValueError(f"run {spec.name!r} is already trained by this trainer")
        run = RunState(RunSpec.of_run(spec, self.cfg, file), self).open()
        try:
            # the adapter's initial values depend on (seed, run name) only, not on the runs added before it
            torch.manual_seed(self.cfg.seed * 1_000_003 + zlib.crc32(run.name.encode()))
            self.model = add_adapter(self.model, run.name, run.spec.lora)
            activate_adapter(self.model, run.name)
            run.build_optimizer(self.model)
            plan = run.resume()
            run.open_intake(plan.trained_step, min(POLL_MS, self.cfg.intake.poll_ms))
        except BaseException:
            run.close()
            self._drop_adapter(run.name)  # a fixed file can add the run again
            raise
        self.runs[run.name] = run
        log.info("run %s joined at step %d (output %s)", run.name, run.trained_step, run.out)
        return run

    def release(self, run: RunState, why: str) -> None:
        """`run` leaves this trainer: its adapter's parameters (and with them their gradients), optimizer,
        schedule, stream reader, metric series, lock and notifier are dropped, so a long-lived trainer
        holds only the runs it trains. Every trained step is committed in the run's folder, so adding
        it again resumes after its last step (a finished run trains nothing more)."""
        step = run.trained_step
        if why != "finished":  # stopped: its restart (the file put back) resumes exactly
            run.checkpoint_on_stop()
        run.close()
        self._drop_adapter(run.name)
        del self.runs[run.name]
        if run.spec.file is not None and why == "finished":
            self._done_files[run.name] = _mtime(run.spec.file)
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

    def scan_runs_dir(self) -> list[RunState]:
        """Follow `runs_dir`: add the runs of new files (a bad file is logged once and skipped until it
        changes), stop the runs whose file was removed. A finished run's file is skipped until it changes
        (e.g. a larger max_steps: the run resumes after its last step)."""
        folder = self.cfg.runs_dir
        if folder is None or not Path(folder).is_dir():
            return []
        files = {file.stem: file for file in sorted(Path(folder).glob("*.toml"))}
        for run in [r for r in self.runs.values() if r.spec.file is not None and r.name not in files]:
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
        for run in self.runs.values():
            run.checkpoint_on_stop()

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
                run.commit(item)
                if run.finished:
                    self.release(run, "finished")
            if self.stop_requested.is_set():
                break
        return True


def _mtime(file: Path) -> float | None:
    try:
        return file.stat().st_mtime
    except OSError:  # removed meanwhile
        return None
