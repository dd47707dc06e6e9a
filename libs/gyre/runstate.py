"""Where a run stands, read from its output folder: the step the trainer has committed.

A step is committed once its weights version is published or its trainer checkpoint is complete
(the trainer saves a due checkpoint before publishing; see gyre_trainer.checkpoint.plan_resume).
A restarted trainer resumes after `committed_step`, so this is also what the launcher and the
orchestrator use to agree with it on the next step; all three read the same files.
"""

from __future__ import annotations

from pathlib import Path

from gyre.steps import StepEntries
from gyre.weights import WeightStore

TRAINER_CHECKPOINTS = Path("checkpoints") / "trainer"
CHECKPOINT_COMPLETE = "progress.json"  # written last into a trainer checkpoint: its presence means complete


def trainer_checkpoints(output_dir: Path | str) -> list[int]:
    """Complete trainer checkpoints, ascending (what `gyre_trainer.checkpoint.CheckpointManager.steps` lists)."""
    return StepEntries(Path(output_dir) / TRAINER_CHECKPOINTS, marker=CHECKPOINT_COMPLETE).steps()


def committed_step(output_dir: Path | str, weights_latest: int | None = None) -> int:
    """The last step the trainer has committed: max(newest published weights, newest checkpoint), 0 if none.

    `weights_latest`: the newest version of the run's weight transport (`gyre.transport`); unset =
    read the `folder` transport's store, `{output_dir}/weights`.
    """
    ckpts = trainer_checkpoints(output_dir)
    if weights_latest is None:
        weights_latest = WeightStore(Path(output_dir) / "weights").latest()
    return max(ckpts[-1] if ckpts else 0, weights_latest or 0)
