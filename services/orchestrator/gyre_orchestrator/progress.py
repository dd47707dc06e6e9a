"""Progress checkpoints of the orchestrator and where a restarted orchestrator resumes.

A checkpoint `{output_dir}/checkpoints/orchestrator/step_{s}.json` is written (atomically) after
batch `s` is in the stream: the last pushed step, the train task sampler's position and cumulative
counters. Tasks are addressed by index (`TaskSource[i]` is a pure function of the seed and i), so
the sampler's state is one integer.

Resume rule (`resume_point`): the next step is one past the newest of
- the checkpoint's step,
- the newest batch still in the Redis stream (pushed after the last checkpoint, maybe not trained yet),
- the newest published weights version (its batch was pushed, even if the stream was trimmed since),
so no step is pushed twice and none is skipped. The task sampler continues after the newest task
index recorded in the checkpoint or in that newest batch's sample metadata (`task_index`), so tasks
are not repeated; tasks drawn for groups still in flight when the orchestrator stopped are skipped.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gyre.fsio import write_atomic

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d+)\.json$")


class ProgressError(RuntimeError):
    """A requested checkpoint does not exist or cannot be read."""


@dataclass
class Progress:
    step: int  # last batch pushed
    task_index: int  # next index of the train TaskSource
    counters: dict[str, int] = field(default_factory=dict)
    created: float = field(default_factory=time.time)


class ProgressStore:
    def __init__(self, root: Path | str, keep_last: int = 3):
        self.root = Path(root)
        self.keep_last = keep_last

    def path(self, step: int) -> Path:
        return self.root / f"step_{step}.json"

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _NAME.match(p.name)))

    def save(self, progress: Progress) -> Path:
        path = write_atomic(self.path(progress.step), json.dumps(asdict(progress), sort_keys=True).encode())
        for old in self.steps()[: -self.keep_last]:
            self.path(old).unlink(missing_ok=True)
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


def resume_point(
    resume_step: int | None,
    store: ProgressStore,
    stream_latest: int | None,
    weights_latest: int | None,
    stream_task_index: int | None = None,
) -> ResumePoint:
    """Where to start; see the module docstring. `resume_step=None` is a fresh start at step 1."""
    if resume_step is None:
        if stream_latest or weights_latest:
            log.warning(
                "starting fresh at step 1 although the stream holds step %s and weights go up to %s; "
                "set resume_step = -1 to continue that run instead",
                stream_latest,
                weights_latest,
            )
        return ResumePoint(1, 0, {}, "fresh start")
    if resume_step == -1 and not store.steps():
        progress = Progress(step=0, task_index=0)
        why = "no checkpoint"
    else:
        progress = store.load(resume_step)
        why = f"checkpoint step {progress.step}"
    last = max(progress.step, stream_latest or 0, weights_latest or 0)
    if last > progress.step:
        why += f", stream up to {stream_latest}, weights up to {weights_latest}"
    task_index = max(progress.task_index, stream_task_index or 0)
    return ResumePoint(last + 1, task_index, dict(progress.counters), why)
