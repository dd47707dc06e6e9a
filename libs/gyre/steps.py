"""One entry per step under a folder: `step_{s}` versions, listed, located, retired and rewound in one home.

Three stores keep one entry per training step on the shared volume, and share this:

- published weights, `weights/step_{s}/` (complete once `MANIFEST.json` is in it: `gyre.weights`);
- trainer checkpoints, `checkpoints/trainer/step_{s}/` (complete once `progress.json` is in it);
- orchestrator progress, `checkpoints/orchestrator/step_{s}.json` (files, complete by their atomic write).

An entry becomes visible only complete (written under a temporary name, then renamed), so listing is a
directory scan plus a completeness check; removing one hides it by a rename first (`gyre.fsio.retire_dir`), so
a reader never sees half a version.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from gyre.fsio import retire_dir


def check_step(step: int) -> int:
    """`step` if it is a non-negative int (a bool is not), else ValueError."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return step


class StepEntries:
    """`step_{s}` entries under `root`: folders complete once they hold `marker`, or files named
    `step_{s}{suffix}` (complete when they exist)."""

    def __init__(self, root: Path | str, *, marker: str | None = None, suffix: str = ""):
        if (marker is None) == (not suffix):
            raise ValueError("step entries are folders with a marker file, or files with a suffix")
        self.root = Path(root)
        self.marker, self.suffix = marker, suffix
        self._name = re.compile(rf"^step_(\d+){re.escape(suffix)}$")

    def path(self, step: int) -> Path:
        return self.root / f"step_{check_step(step)}{self.suffix}"

    def steps(self) -> list[int]:
        """Complete entries, ascending."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in os.scandir(self.root):
            m = self._name.match(entry.name)
            if m is None:
                continue
            complete = entry.is_file() if self.marker is None else os.path.isfile(os.path.join(entry.path, self.marker))
            if complete:
                found.append(int(m.group(1)))
        return sorted(found)

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def remove(self, steps: Iterable[int]) -> list[int]:
        """Delete these entries (folders hidden by a rename first); returns them."""
        removed = []
        for step in steps:
            path = self.path(step)
            if self.marker is None:
                path.unlink(missing_ok=True)
            else:
                retire_dir(path)
            removed.append(step)
        return removed

    def discard_after(self, step: int) -> list[int]:
        """Delete entries newer than `step` (a run rewound to `step` abandons them)."""
        return self.remove([s for s in self.steps() if s > step])

    def keep_only(self, keep: Iterable[int]) -> list[int]:
        """Delete every complete entry not in `keep` (retention); returns the deleted steps."""
        keep = set(keep)
        return self.remove([s for s in self.steps() if s not in keep])
