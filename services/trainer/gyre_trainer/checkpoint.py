"""Trainer checkpoints and the resume plan.

A checkpoint of step `s` lives in `{output_dir}/checkpoints/trainer/step_{s}/`:

    state/            torch.distributed.checkpoint (DCP) of {"model", "optim"}: one shard file per
                      rank plus `.metadata`, so a checkpoint saved by N ranks loads on M ranks
    scheduler.pt      LR scheduler state (identical on every rank; rank 0 writes it)
    rng_rank{r}.pt    torch (+ CUDA) and python RNG state of rank r
    progress.json     {"step", "world_size", "record", "created", and the trainer's "grad_norm_history" (the
                      spike detector's window, `gyre_trainer.debug`) and "dtype" (the parameters' training
                      dtype, which a LoRA checkpoint's float32 adapters do not tell: `gyre_trainer.export`)}:
                      written last

DCP is used also for a single process, so there is one format and any world size can resume it.

Atomicity: every rank writes into `.tmp-step_{s}` (a fixed name all ranks agree on without talking;
rank 0 clears a leftover of a crashed attempt first), then rank 0 fsyncs and renames the folder.
A `step_{s}` folder therefore exists only complete; a crash leaves at most a `.tmp-*` folder that
`steps()` ignores and the next save removes. The shared volume must be visible to every rank
(one node with torchrun, or a shared filesystem).
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gyre.fsio import commit_dir, free_space, write_atomic
from gyre.runstate import CHECKPOINT_COMPLETE as PROGRESS
from gyre.steps import StepEntries

from gyre_trainer.dist import DistContext, barrier
from gyre_trainer.process import crash_point

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A requested checkpoint is missing or unusable."""


class CheckpointManager:
    """Save / load / list / prune trainer checkpoints under `root` (collective when distributed)."""

    def __init__(self, root: Path | str, ctx: DistContext, keep_last: int | None = 2, keep_interval: int | None = None):
        self.root = Path(root)
        self.ctx = ctx
        self.keep_last = keep_last
        self.keep_interval = keep_interval
        self.entries = StepEntries(self.root, marker=PROGRESS)  # complete checkpoints: progress.json inside

    @property
    def single(self) -> bool:
        return not self.ctx.distributed

    def path(self, step: int) -> Path:
        return self.entries.path(step)

    def steps(self) -> list[int]:
        """Complete checkpoints, ascending."""
        return self.entries.steps()

    def latest(self) -> int | None:
        return self.entries.latest()

    # ---- save -----------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, scheduler, record: dict[str, Any] | None = None, **extra: Any) -> Path:
        """Write checkpoint `step` atomically; every rank must call it. Returns the final folder.

        `extra`: more JSON state of the step, kept in progress.json beside the record (the trainer's
        `grad_norm_history`); `load` returns it with the rest of progress.json."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict

        tmp = self.root / f".tmp-step_{step}"
        try:
            if self.ctx.is_main:
                # every partial folder first, not just this step's: a save SIGKILLed in its grace period (an
                # on-stop checkpoint of step 7) left .tmp-step_7, as large as a checkpoint, which the interval
                # save of step 10 then wrote beside: a volume with room for one more checkpoint ran full
                self.remove_partial()
                tmp.mkdir(parents=True)
            barrier(self.ctx)
            model_sd, optim_sd = get_state_dict(model, optimizer)
            model_sd = trainable_only(model, model_sd)
            with _single_process_ok():
                state = {"model": model_sd, "optim": optim_sd}
                dcp.save(state, checkpoint_id=tmp / "state", no_dist=not self.ctx.distributed)
            torch.save(_rng_state(), tmp / f"rng_rank{self.ctx.rank}.pt")
            crash_point("mid_checkpoint", step, self.ctx)
            barrier(self.ctx)  # every shard is on disk before rank 0 declares the checkpoint complete
            if self.ctx.is_main:
                torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
                progress = {"step": step, "world_size": self.ctx.world_size, "record": record, "created": time.time(),
                            **extra}  # fmt: skip
                write_atomic(tmp / PROGRESS, json.dumps(progress, indent=1).encode())
                for file in tmp.rglob("*"):
                    if file.is_file():
                        file.chmod(0o644)  # readable by other pods' users sharing the volume (fsGroup)
                final = commit_dir(tmp, self.path(step))  # a rewound run saving this step again replaces it
        except (Exception, CheckpointException) as e:
            # A full or unwritable volume: DCP's own error is a BaseException (CheckpointException, missed by every
            # `except Exception` up to main) reading "[enforce fail at inline_container.cc] unexpected pos 704 vs
            # 598", naming neither the folder nor the cause, and the partial folder kept the volume full until the
            # next save. Say where and what, drop the partial folder; the complete checkpoints are untouched.
            error = CheckpointError(
                f"saving checkpoint step {step} into {self.root} failed: {one_line(e)} ({free_space(self.root)}); "
                f"it was not committed, the complete checkpoints {self.steps() or '(none)'} are intact"
            )  # the free space before the partial folder goes: what the save found
            if self.ctx.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise error from (e if isinstance(e, Exception) else None)
        if self.ctx.is_main:
            log.info("saved checkpoint step %d at %s", step, final)
            self.prune()
        barrier(self.ctx)
        return self.path(step)

    # ---- load -----------------------------------------------------------------------------------
    def load(self, step: int, model, optimizer, scheduler) -> dict[str, Any]:
        """Restore model, optimizer, scheduler and this rank's RNG from checkpoint `step`; returns progress.

        Every rank must call it. A checkpoint saved with another world size loads too (DCP reshards);
        ranks that have no RNG file of their own are reseeded from (step, rank).
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

        folder = self.path(step)
        progress = read_progress(folder, step)
        configured = configured_hyperparameters(optimizer, scheduler)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": trainable_only(model, model_sd), "optim": optim_sd}
        check_saved_shapes(folder / "state", state["model"])
        drop_unsaved_master_weights(folder / "state", state["optim"])
        saved_groups = saved_param_groups(folder / "state")
        if saved_groups != len(optim_sd["param_groups"]):
            # other parameter groups than the config builds (trainer.lora.lr_ratio_b 1 <-> not 1): DCP refused the
            # whole checkpoint ("Missing key ... optim.param_groups.1.weight_decay"), a crash loop on every restart.
            # The moments are per parameter: load them alone; the groups stay the config's (as their settings would)
            state["optim"] = {"state": optim_sd["state"]}
        with _single_process_ok():
            try:
                dcp.load(state, checkpoint_id=folder / "state", no_dist=self.single)
            except CheckpointException as e:  # a BaseException: as a CheckpointError main reports it as a failure
                raise CheckpointError(f"checkpoint step {step} at {folder} is unreadable: {one_line(e)}") from None
        state["optim"].setdefault("param_groups", optim_sd["param_groups"])
        partial = len(state["model"]) < len(model_sd)  # LoRA: the frozen base comes from the base model
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
            options=StateDictOptions(strict=not partial),
        )  # fmt: skip
        scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
        keep_configured_hyperparameters(optimizer, scheduler, configured, step, saved_groups)
        rng_file = folder / f"rng_rank{self.ctx.rank}.pt"
        if rng_file.exists():
            _set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            log.warning("checkpoint step %d has no RNG state for rank %d; reseeding", step, self.ctx.rank)
            torch.manual_seed(step * 1_000_003 + self.ctx.rank)
        log.info("loaded checkpoint step %d from %s (saved by %s ranks)", step, folder, progress.get("world_size"))
        return progress

    def read_record(self, step: int) -> dict[str, Any] | None:
        """The step's event record stored with the checkpoint (None if absent)."""
        try:
            return json.loads((self.path(step) / PROGRESS).read_bytes()).get("record")
        except (OSError, ValueError):
            return None

    # ---- retention ------------------------------------------------------------------------------
    def prune(self) -> list[int]:
        """Delete checkpoints outside `keep_last` newest and multiples of `keep_interval` (rank 0 only).

        The newest checkpoint is always kept. Stale `.tmp-*` folders are removed too: they belong to
        a crashed save (a live save of this trainer is never concurrent with prune).
        """
        steps = self.steps()
        keep = set(steps[-self.keep_last :]) if self.keep_last else set(steps)
        if steps:
            keep.add(steps[-1])
        if self.keep_interval:
            keep |= {s for s in steps if s % self.keep_interval == 0}
        deleted = self.entries.keep_only(keep)
        self.remove_partial()
        if deleted:
            log.info("pruned checkpoints %s", deleted)
        return deleted

    def remove_partial(self) -> None:
        """Delete the `.tmp-*` folders of saves that did not complete (rank 0, never during its own save)."""
        for folder in partial_saves(self.root):
            shutil.rmtree(folder, ignore_errors=True)

    def discard_after(self, step: int) -> list[int]:
        """Delete checkpoints newer than `step` (a run rewound to `step` abandons them). Rank 0 only."""
        return self.entries.discard_after(step)


def read_progress(folder: Path, step: int) -> dict[str, Any]:
    """Checkpoint `folder`'s progress.json, after checking that it is step `step` and that its DCP index reads."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        progress = json.loads((folder / PROGRESS).read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint step {step} at {folder} is missing or unreadable: {e}") from None
    if progress.get("step") != step:
        raise CheckpointError(f"checkpoint folder {folder} holds step {progress.get('step')}, not {step}")
    try:  # what the checks after it read first; a damaged or missing index is a traceback naming no folder
        FileSystemReader(str(folder / "state")).read_metadata()
    except Exception as e:
        raise CheckpointError(f"checkpoint step {step} at {folder} is unreadable: {one_line(e)}") from None
    return progress


def load_model_state(folder: Path, step: int, model) -> dict[str, Any]:
    """The model's tensors of checkpoint `folder` (step `step`) onto `model`, in one process, without the optimizer
    state (`gyre_trainer.export`); returns progress.json. LoRA: `model` has the adapter, the checkpoint gives it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    progress = read_progress(folder, step)
    full = get_model_state_dict(model)
    state = {"model": trainable_only(model, full)}
    check_saved_shapes(folder / "state", state["model"])
    with _single_process_ok():
        try:
            dcp.load(state, checkpoint_id=folder / "state", no_dist=True)
        except CheckpointException as e:
            raise CheckpointError(f"checkpoint step {step} at {folder} is unreadable: {one_line(e)}") from None
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=len(state["model"]) == len(full)))
    return progress


def partial_saves(*roots: Path) -> list[Path]:
    """The `.tmp-*` folders under `roots`: checkpoints or weights versions a crash cut short before their commit."""
    return sorted(entry for root in roots if root.is_dir() for entry in root.iterdir()
                  if entry.name.startswith(".tmp-") and entry.is_dir() and not entry.is_symlink())  # fmt: skip


def one_line(error: BaseException) -> str:
    """`error` in one line: a DCP CheckpointException's message is a traceback per rank; its failures say it."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {rank}: {one_line(exc)}" for rank, (exc, _trace) in sorted(failures.items()))
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def saved_param_groups(state_dir: Path) -> int:
    """How many optimizer parameter groups checkpoint `state_dir` holds."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(state_dir)).read_metadata().state_dict_metadata
    return sum(1 for key in metadata if key.startswith("optim.param_groups.") and key.endswith(".params"))


def drop_unsaved_master_weights(state_dir: Path, optim_sd: dict[str, Any]) -> None:
    """A bf16 checkpoint written before `optim.master_weights` (or with it off) has no float32 master copies:
    load the rest, and the first step after it builds the copies from the parameters (`MasterWeightAdamW`).
    DCP would refuse the whole checkpoint for the missing keys."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(state_dir)).read_metadata().state_dict_metadata
    for fqn, entry in optim_sd.get("state", {}).items():
        if "master" in entry and f"optim.state.{fqn}.master" not in metadata:
            del entry["master"]


def check_saved_shapes(state_dir: Path, model_sd: dict[str, Any]) -> None:
    """ValueError naming the setting when checkpoint `state_dir` does not hold exactly `model_sd`'s tensors
    in their shapes: a run re-launched with another `lora.rank`, other `lora.target_modules` or another
    model. DCP itself would fail with a page of size mismatches, or, for adapters the relaunch no longer
    has, load the rest and silently drop what they had learned."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(state_dir)).read_metadata().state_dict_metadata
    saved = {key.removeprefix("model."): tuple(meta.size) for key, meta in metadata.items()
             if key.startswith("model.") and hasattr(meta, "size")}  # fmt: skip
    missing, unknown = sorted(model_sd.keys() - saved.keys()), sorted(saved.keys() - model_sd.keys())
    if missing or unknown:
        lora_saved, lora_wanted = (any(".lora_" in k for k in keys) for keys in (saved, model_sd))
        if lora_saved != lora_wanted:
            what = f"was trained {'with' if lora_saved else 'without'} trainer.lora"
        elif lora_saved:
            what = "has another adapter: other modules than trainer.lora.target_modules gives"
        else:
            what = "holds another model than model.name"
        raise ValueError(f"checkpoint {state_dir.parent} {what}: missing {missing[:3]}, unknown {unknown[:3]} "
                         f"(a run keeps its model and adapter shape)")  # fmt: skip
    for name, value in model_sd.items():
        wanted = tuple(value.shape)  # a DTensor's shape is the global one, as saved
        if saved[name] == wanted:
            continue
        if ".lora_A." in name or ".lora_B." in name:
            from gyre_trainer.lora import rank_mismatch

            raise rank_mismatch(name, saved[name], wanted)
        raise ValueError(f"checkpoint {state_dir.parent} holds {name} as {list(saved[name])}, the model has "
                         f"{list(wanted)}: the run was trained on another model.name")  # fmt: skip


#: Optimizer settings a checkpoint must not override: the run's config says them (`optim.*`).
HYPERPARAMETERS = ("initial_lr", "betas", "eps", "weight_decay")


def configured_hyperparameters(optimizer, scheduler) -> tuple[list[dict[str, Any]], list[float]]:
    """The optimizer's settings as built from the config, before a checkpoint overwrites them."""
    groups = [{k: group[k] for k in HYPERPARAMETERS if k in group} for group in optimizer.param_groups]
    return groups, list(scheduler.base_lrs)


def keep_configured_hyperparameters(
    optimizer, scheduler, configured, step: int, saved_groups: int | None = None
) -> None:
    """Put the config's optimizer settings back after loading a checkpoint, keeping its moments and step.

    torch restores every param group's `lr`, `betas`, `eps` and `weight_decay` with the optimizer state, and
    LambdaLR its `base_lrs`: a run resumed (or rewound with `ckpt.resume_step`) with a lower `optim.lr` kept
    training at the old one, silently. Here the config wins and the schedule continues at the checkpoint's
    step with the configured peak; with an unchanged config nothing is touched (resumes stay bit-exact).
    A checkpoint of other parameter groups (`saved_groups`: `trainer.lora.lr_ratio_b` 1 <-> not 1 joins or splits
    the adapters' groups) gave the moments alone: the groups are the config's, their lr set for the step here.
    """
    groups, base_lrs = configured
    if saved_groups is not None and saved_groups != len(groups):
        changed = [f"{saved_groups} parameter group(s) -> {len(groups)} (trainer.lora.lr_ratio_b)"]
    else:
        changed = [f"{key} {saved[key]} -> {value}"
                   for saved, wanted in zip(optimizer.param_groups, groups, strict=True)
                   for key, value in wanted.items() if key != "initial_lr" and saved.get(key) != value]  # fmt: skip
        changed += [f"lr {old} -> {new}" for old, new in zip(scheduler.base_lrs, base_lrs, strict=True) if old != new]
    if not changed:
        # the same settings, but perhaps another schedule (optim.scheduler, warmup_steps, decay_steps, min_lr_ratio, a
        # longer max_steps): the groups hold the checkpoint schedule's lr, which the first resumed step used before the
        # new schedule took over at the next one. Equal floats when nothing changed (LambdaLR's own formula).
        scheduled = [base * lr_lambda(scheduler.last_epoch) for base, lr_lambda in zip(base_lrs, scheduler.lr_lambdas,
                                                                                      strict=True)]  # fmt: skip
        saved = [group["lr"] for group in optimizer.param_groups]
        if scheduled == saved:
            return
        changed = [f"lr at step {step} {saved[0]:.6g} -> {scheduled[0]:.6g} (optim.scheduler, warmup_steps, "
                   "decay_steps, min_lr_ratio or max_steps)"]  # fmt: skip
    scheduler.base_lrs = base_lrs
    for group, wanted, base, lr_lambda in zip(optimizer.param_groups, groups, base_lrs, scheduler.lr_lambdas,
                                              strict=True):  # fmt: skip
        group.update(wanted)
        group["lr"] = base * lr_lambda(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    log.warning("checkpoint step %d: optimizer settings differ from the config, which is used: %s",
                step, "; ".join(sorted(set(changed))))  # fmt: skip


def trainable_only(model, model_sd: dict[str, Any]) -> dict[str, Any]:
    """The state dict's trainable entries when part of the model is frozen (LoRA: the adapters), else
    all of it: a checkpoint holds what training changes, the frozen base is reloaded from the base model."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    if not frozen:
        return model_sd
    return {name: value for name, value in model_sd.items() if name not in frozen}


@contextlib.contextmanager
def _single_process_ok():
    """DCP warns that it "assumes" a single process when torch.distributed is off: that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- resume plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResumePlan:
    """How a starting trainer reconstructs its state. See `plan_resume` for the rules.

    - `trained_step`: the last committed step; training continues with batch `trained_step + 1`.
    - `checkpoint_step`: load model, optimizer, scheduler and RNG from this checkpoint (None: fresh).
    - `weights_step`: then overwrite the parameters with these published weights (None: don't).
    - `republish`: the checkpoint is newer than every published version: publish it before training.
    - `discard_after`: a rewind: checkpoints and weights newer than this step must be deleted first.
    """

    trained_step: int
    checkpoint_step: int | None = None
    weights_step: int | None = None
    republish: bool = False
    discard_after: int | None = None

    def source(self) -> str:
        """Where the resumed state comes from, in words (for the log)."""
        if self.checkpoint_step is None and self.weights_step is None:
            return "the base model"
        parts = [f"checkpoint step {self.checkpoint_step}"] if self.checkpoint_step is not None else []
        if self.weights_step is not None:
            parts.insert(0, f"published weights step {self.weights_step}")
        return " and ".join(parts)

    @property
    def exact(self) -> bool:
        """True when the full training state (incl. optimizer moments) is that of `trained_step`."""
        return self.weights_step is None


def plan_resume(resume_step: int | None, checkpoints: list[int], latest_weights: int | None) -> ResumePlan:
    """Decide where training resumes from the run's durable state.

    A step `s` is **committed** once its weights version is published or its checkpoint is saved
    (the trainer saves the checkpoint of `s`, when one is due, *before* publishing weights `s`).
    The last committed step is `max(newest checkpoint, newest weights)`, and that is what a
    restarted trainer treats as trained: it acks and skips replayed batches up to it and waits for
    the next one. Hence every step trains exactly once, whichever instant a crash hits:

    - before the checkpoint/publish of `s`: nothing of `s` is durable, batch `s` is still pending
      in Redis (acked only after publishing) and is trained again from the state of `s-1`;
    - between checkpoint `s` and publishing `s`: the checkpoint holds the exact post-step state;
      weights `s` are published from it (`republish`) and training goes on at `s+1`;
    - after publishing `s` (before or after the ack): `s` is committed and never trained again.

    The resumed state is bit-exact when the newest checkpoint is the last committed step (always
    true with `ckpt.interval = 1`). When published weights are newer than the newest checkpoint
    (sparser checkpoints, or none), the parameters come from those weights (exact) but optimizer
    moments come from the older checkpoint or start fresh: exactly-once still holds, bit-equality
    with an uninterrupted run does not.

    `resume_step`: None = automatic (the above; a fresh start when the run has no state yet),
    -1 = the same but a checkpoint must exist, `s >= 0` = rewind to checkpoint `s` (0 = the base
    model), abandoning newer checkpoints and weights.
    """
    newest_ckpt = checkpoints[-1] if checkpoints else None
    if resume_step is not None and resume_step >= 0:
        if resume_step and resume_step not in checkpoints:
            raise CheckpointError(f"ckpt.resume_step={resume_step}: no such checkpoint (have {checkpoints or 'none'})")
        newer = (newest_ckpt or 0) > resume_step or (latest_weights or 0) > resume_step
        return ResumePlan(
            trained_step=resume_step,
            checkpoint_step=resume_step or None,
            republish=bool(resume_step),  # idempotent when weights `s` still exist unchanged
            discard_after=resume_step if newer else None,
        )
    if resume_step == -1 and newest_ckpt is None:
        raise CheckpointError("ckpt.resume_step=-1: there is no checkpoint to resume from")
    ckpt, weights = newest_ckpt or 0, latest_weights or 0
    if ckpt == 0 and weights == 0:
        return ResumePlan(trained_step=0)
    if ckpt >= weights:
        return ResumePlan(trained_step=ckpt, checkpoint_step=ckpt, republish=ckpt > weights)
    return ResumePlan(trained_step=weights, checkpoint_step=newest_ckpt, weights_step=weights)
