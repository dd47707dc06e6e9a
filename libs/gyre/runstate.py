"""Where a run stands, read from its output folder: the step the trainer has committed, and the rewind each
service has done.

A step is committed once its weights version is published or its trainer checkpoint is complete
(the trainer saves a due checkpoint before publishing; see gyre_trainer.checkpoint.plan_resume).
A restarted trainer resumes after `committed_step`, so this is also what the launcher and the
orchestrator use to agree with it on the next step; all three read the same files.
"""

from __future__ import annotations

import os
from pathlib import Path

from gyre.fsio import write_atomic
from gyre.steps import StepEntries
from gyre.weights import WeightStore

TRAINER_CHECKPOINTS = Path("checkpoints") / "trainer"
CHECKPOINT_COMPLETE = "progress.json"  # written last into a trainer checkpoint: its presence means complete
ORCHESTRATOR_PROGRESS = Path("checkpoints") / "orchestrator"
SFT_CHECKPOINTS = Path("checkpoints") / "sft"  # `gyre sft`'s, complete ones holding CHECKPOINT_COMPLETE too
REWOUND = "rewound"  # in a service's checkpoint folder: the step of the rewind it has done
RL_WARM_UP_ENV = "GYRE_RL_WARM_UP_OF"  # set by `gyre rl` for its SFT warm-up: the run folder (resolved) it trains in


def trainer_checkpoints(output_dir: Path | str) -> list[int]:
    """Complete trainer checkpoints, ascending (what `gyre_trainer.checkpoint.CheckpointManager.steps` lists)."""
    return StepEntries(Path(output_dir) / TRAINER_CHECKPOINTS, marker=CHECKPOINT_COMPLETE).steps()


def sft_checkpoints(output_dir: Path | str) -> list[int]:
    """Complete `gyre sft` checkpoints, ascending."""
    return StepEntries(Path(output_dir) / SFT_CHECKPOINTS, marker=CHECKPOINT_COMPLETE).steps()


def sft_resume_problem(resume_step: int | None, checkpoints: list[int], max_steps: int,
                       where: Path | str) -> tuple[str, str] | None:  # fmt: skip
    """(key, why) when `gyre sft` cannot resume as asked from its checkpoints (in `where`): a `resume_step` checkpoint
    that does not exist (it failed with a traceback once the model had loaded), or a checkpoint to resume from past
    `max_steps` (nothing was trained and that checkpoint's weights were saved as the result of step `max_steps`).
    None: it can. Shared by `gyre sft` and `gyre rl`, which checks its warm-up before anything starts."""
    if resume_step is not None and resume_step > 0 and resume_step not in checkpoints:
        return "ckpt.resume_step", f"no SFT checkpoint of step {resume_step} in {where} (have {checkpoints or 'none'})"
    if resume_step == -1 and not checkpoints:
        return "ckpt.resume_step", f"-1 resumes from an SFT checkpoint, and {where} has none"
    start = resume_step if resume_step is not None and resume_step >= 0 else max(checkpoints, default=0)
    if start > max_steps:
        return "max_steps", (
            f"training resumes from checkpoint step {start} in {where}, past max_steps {max_steps}: the result "
            f"would hold step {start}'s weights; raise max_steps, or rewind to a checkpoint at or before it with "
            f"ckpt.resume_step (have {checkpoints})"
        )
    return None


def committed_step(output_dir: Path | str, weights_latest: int | None = None) -> int:
    """The last step the trainer has committed: max(newest published weights, newest checkpoint), 0 if none.

    `weights_latest`: the newest version of the run's weight transport (`gyre.transport`); unset =
    read the `folder` transport's store, `{output_dir}/weights`.
    """
    ckpts = trainer_checkpoints(output_dir)
    if weights_latest is None:
        weights_latest = WeightStore(Path(output_dir) / "weights").latest()
    return max(ckpts[-1] if ckpts else 0, weights_latest or 0)


def run_started(output_dir: Path | str) -> bool:
    """Whether a run folder holds a run: a step trained (weights, a checkpoint) or a batch pushed (the orchestrator's
    step record, written before each push)."""
    from gyre.events import ORCHESTRATOR_STEPS, events_dir

    return bool(committed_step(output_dir) or trainer_checkpoints(output_dir)
                or (events_dir(output_dir) / ORCHESTRATOR_STEPS).exists())  # fmt: skip


def rl_run_in(output_dir: Path | str) -> str | None:
    """Why `output_dir` is a `gyre rl` run's folder, said for an error; None when it is not one. A launch running
    there (its pid), a committed trainer step, a batch pushed (generated from the run's base model), or the trainer
    config a launch writes once its base model and SFT warm-up are ready. The `gyre sft` a launch runs as its warm-up
    (`RL_WARM_UP_ENV` naming this folder) is the run's own."""
    from gyre.runlock import running_holder

    out = Path(output_dir)
    if os.environ.get(RL_WARM_UP_ENV) == str(out.resolve()):
        return None
    if (holder := running_holder(out, "rl")) is not None:
        return f"gyre rl pid {holder['pid']} is running in it"
    if step := committed_step(out):
        return f"its trainer has committed step {step}"
    if run_started(out):
        return "its orchestrator has pushed batches, no step trained yet"
    if (out / "configs" / "trainer.toml").is_file():
        return "a launch wrote its configs/trainer.toml, no step trained yet"
    return None


def orchestrator_progress(output_dir: Path | str) -> list[int] | None:
    """The orchestrator's progress checkpoints in this run folder, ascending; None when it writes none here."""
    root = Path(output_dir) / ORCHESTRATOR_PROGRESS
    return StepEntries(root, suffix=".json").steps() if root.is_dir() else None


def pending_rewind(folder: Path | str, resume_step: int | None) -> int | None:
    """The `resume_step` a service starting with it acts on: a rewind (N >= 0) once, then None (resume where the run
    stands). A Kubernetes pod keeps its `resume_step` when it restarts (a crash, a drained node): rewinding again
    would delete the steps trained since. `folder`: the service's checkpoint folder, which records the rewind done
    (`mark_rewound`); a start without a rewind forgets it, so the same step set again later rewinds again."""
    mark = Path(folder) / REWOUND
    if resume_step is None or resume_step < 0:
        mark.unlink(missing_ok=True)
        return resume_step
    try:
        done = int(mark.read_text())
    except (OSError, ValueError):
        return resume_step
    return None if done == resume_step else resume_step


def mark_rewound(folder: Path | str, step: int) -> None:
    """Record that this service has rewound the run to `step` (see `pending_rewind`)."""
    write_atomic(Path(folder) / REWOUND, str(step).encode())


def forget_rewinds(output_dir: Path | str) -> None:
    """A new request to rewind (`gyre rl --ckpt.resume-step N`, run again): every service rewinds, also to a step it
    rewound to before."""
    for folder in (TRAINER_CHECKPOINTS, ORCHESTRATOR_PROGRESS):
        (Path(output_dir) / folder / REWOUND).unlink(missing_ok=True)
