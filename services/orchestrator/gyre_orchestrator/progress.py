"""Progress checkpoints of the orchestrator and where a restarted orchestrator resumes.

A checkpoint `{output_dir}/checkpoints/orchestrator/step_{s}.json` is written (atomically) after
batch `s` is in the stream: the last pushed step, the train task sampler's position and cumulative
counters. Tasks are addressed by index (`TaskSource[i]` is a pure function of the seed and i), so
the sampler's state is one integer per environment (`cursors`, by label; `task_index` is the first's, what
checkpoints from before mixes hold) and, for a mix, the number of draws (`gyre_orchestrator.mix`).

Resume rule (`resume_point`), the same for a restarted pod, a re-run of `gyre rl` and a crash:
the orchestrator continues from what the *trainer* can consume, not from its own checkpoint.

- `committed`: the trainer's last committed step (newest published weights or complete trainer
  checkpoint, `gyre.runstate.committed_step`); a restarted trainer resumes right after it;
- the batches of steps `committed+1, committed+2, ...` still in the Redis stream are already
  pushed and will be trained: the next step is one past the last of them that follows without a gap;
- so the next step is `committed + 1 + (pushed batches the stream still holds)`. Nothing is pushed
  twice, and when the stream lost batches (Redis restarted without persistence) they are generated
  again instead of being waited for by the trainer forever.

The progress checkpoint supplies the task sampler's position and the cumulative counters. The
sampler continues after the newest task index recorded in the checkpoint or in the newest batch's
sample metadata (`task_index` per `env`, and `draw`), so tasks are not repeated (also when a lost step is regenerated);
tasks drawn for groups still in flight when the orchestrator stopped are skipped.

`resume_step`: unset or -1 = the rule above (a fresh start when the run has no state yet);
`N >= 0` = a rewind to step N together with the trainer (`ckpt.resume_step = N`): the next step is
N+1, the sampler position comes from progress checkpoint N, and stream entries after N are deleted.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gyre.fsio import write_atomic
from gyre.steps import StepEntries

log = logging.getLogger(__name__)


class ProgressError(RuntimeError):
    """A requested checkpoint does not exist or cannot be read."""


@dataclass
class Progress:
    step: int  # last batch pushed
    task_index: int  # next index of the train TaskSource (a mix: of its first entry's)
    counters: dict[str, int] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    cursors: dict[str, int] = field(default_factory=dict)  # label -> next index of its train split (none: older)
    draws: int = 0  # groups drawn by the mix so far
    # what the task positions index into: the task sampler's seed and the dumped orchestrator.env (None: older)
    seed: int | None = None
    env: Any = None


class ProgressStore:
    """`checkpoints/orchestrator/step_{s}.json` files (`gyre.steps`); the newest `keep_last` are kept, and those of
    the steps `also_keep()` names (the trainer's checkpoints: a rewind to one needs its progress checkpoint)."""

    def __init__(self, root: Path | str, keep_last: int = 3, also_keep: Callable[[], Iterable[int]] | None = None):
        self.root = Path(root)
        self.keep_last = keep_last
        self.also_keep = also_keep
        self.entries = StepEntries(self.root, suffix=".json")

    def path(self, step: int) -> Path:
        return self.entries.path(step)

    def steps(self) -> list[int]:
        return self.entries.steps()

    def save(self, progress: Progress) -> Path:
        path = write_atomic(self.path(progress.step), json.dumps(asdict(progress), sort_keys=True).encode())
        # the trainer keeps checkpoints for good (ckpt.keep_interval) that a keep_last window pruned the progress of:
        # a rewind to one (ckpt.resume_step = N) then failed at the orchestrator, "no progress checkpoint of step N"
        kept = set(self.also_keep()) if self.also_keep is not None else set()
        self.entries.keep_only(kept | set(self.steps()[-self.keep_last :]))
        return path

    def load(self, step: int) -> Progress:
        """Checkpoint `step` (-1 = the newest); `ProgressError` if it is missing or unreadable."""
        if step == -1:
            steps = self.steps()
            if not steps:
                raise ProgressError(f"no orchestrator progress checkpoint in {self.root}")
            step = steps[-1]
        try:
            doc = json.loads(self.path(step).read_bytes())
            return Progress(
                step=int(doc["step"]),
                task_index=int(doc["task_index"]),
                counters={str(k): int(v) for k, v in doc.get("counters", {}).items()},
                created=float(doc.get("created", 0.0)),
                cursors={str(k): int(v) for k, v in doc.get("cursors", {}).items()},
                draws=int(doc.get("draws", 0)),
                seed=None if doc.get("seed") is None else int(doc["seed"]),
                env=doc.get("env"),
            )
        except FileNotFoundError:
            raise ProgressError(
                f"no progress checkpoint for step {step} in {self.root} (have {self.steps()})"
            ) from None
        except (ValueError, KeyError, TypeError) as e:
            raise ProgressError(f"{self.path(step)} is not a valid progress checkpoint: {e}") from None


@dataclass
class ResumePoint:
    start_step: int  # first step to generate
    task_index: int
    counters: dict[str, Any]
    reason: str
    cursors: dict[str, int] = field(default_factory=dict)  # label -> next task index (empty: none recorded)
    draws: int = 0


def resume_point(
    resume_step: int | None,
    store: ProgressStore,
    committed: int,
    stream_steps: list[int],
    stream_task_index: int | None = None,
    *,
    cursors: dict[str, int] | None = None,
    stream_draws: int | None = None,
) -> ResumePoint:
    """Where to start; see the module docstring. `stream_steps`: steps of the entries after `committed`;
    `cursors` and `stream_draws`: the positions the newest batch in the stream records (per entry, draws)."""
    if resume_step is not None and resume_step >= 0:
        progress = store.load(resume_step) if resume_step > 0 else Progress(step=0, task_index=0)
        return ResumePoint(resume_step + 1, progress.task_index, dict(progress.counters), f"rewind to {resume_step}",
                           dict(progress.cursors), progress.draws)  # fmt: skip
    saved = store.load(-1) if store.steps() else None
    pushed, have = committed, set(stream_steps)
    while pushed + 1 in have:
        pushed += 1
    stream = cursors or {}
    merged = {k: max((saved.cursors if saved else {}).get(k, 0), stream.get(k, 0)) for k in {
        **(saved.cursors if saved else {}), **stream}}  # fmt: skip
    draws = max(saved.draws if saved else 0, stream_draws or 0)
    if saved is None and pushed == 0:
        return ResumePoint(1, stream_task_index or 0, {}, "fresh start", merged, draws)
    why = f"trainer committed step {committed}"
    if pushed > committed:
        why += f", stream holds steps {committed + 1}..{pushed}"
    if saved is not None and saved.step > pushed:
        log.warning(
            "batches %d..%d were pushed before but are not in the stream any more (Redis lost them): "
            "generating them again from step %d",
            pushed + 1,
            saved.step,
            pushed + 1,
        )
        why += f", regenerating from {pushed + 1} (checkpoint said {saved.step})"
    task_index = max(saved.task_index if saved else 0, stream_task_index or 0)
    return ResumePoint(pushed + 1, task_index, dict(saved.counters) if saved else {}, why, merged, draws)
