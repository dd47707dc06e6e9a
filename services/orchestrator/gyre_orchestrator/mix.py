"""Which environment and task each group of a step comes from: one environment, or a weighted mix of several.

`[[orchestrator.env]]` entries train one policy on a mix (PRIME-RL's `[[orchestrator.env]]` with
`buffer.env_ratios`, verifiers' `EnvGroup`): every group (a task and its `rollouts_per_example` samples) comes
from one entry, drawn with probability `ratio / sum(ratios)`. Advantages stay per group, so each entry's rewards
are only ever compared with its own; each entry keeps its own rubric (and judges).

The draw is deterministic and resumable. Draw `n` picks its entry from the point `frac(offset + n * phi)` of the
unit interval split by the shares (`offset` drawn from `seed`, `phi` the golden ratio's fraction): a pure function of
(`seed`, `n`), so the sequence needs no RNG state. This low-discrepancy sequence keeps every run of consecutive draws
within about 2 groups of the ratios (independent random draws gave a step of 8 groups at 3:1 a 4:4 mix, often).
Each entry reads its train split in index order from its own cursor. The whole state is the draw count and one
cursor per entry (keyed by its label), saved in the progress checkpoints and recovered from the newest batch's
samples (`env`, `task_index`, `draw`): a restart continues the same sequence, repeating and skipping no task.
Changing the ratios between launches changes only the draws to come; an entry added later starts at its split's
beginning; an entry removed keeps its cursor in the checkpoints, and continues from it if it comes back.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass
from typing import Any

PHI = (math.sqrt(5) - 1) / 2  # the golden ratio's fraction: the best-spread Weyl sequence


@dataclass(frozen=True)
class MixTask:
    """A task drawn for a group: from entry `env` (its label), the `index`-th of its train split, draw `draw`."""

    env: str
    index: int
    draw: int | None  # None: a dropped group's replacement from its own entry (advantage.refill = "entry")
    task: Any


class TaskMix:
    """Draw each group's entry by ratio, then that entry's next train task.

    `sources`: label -> the entry's train `TaskSource` (config order); `ratios`: label -> its weight (> 0).
    `cursors`: label -> the next index of its split (entries not in `sources` are kept for `state`)."""

    def __init__(
        self,
        sources: dict[str, Any],
        ratios: dict[str, float],
        *,
        seed: int = 0,
        cursors: dict[str, int] | None = None,
        draws: int = 0,
    ):
        if not sources or set(sources) != set(ratios):
            raise ValueError("a mix needs at least one source, each with a ratio")
        if any(not ratio > 0 for ratio in ratios.values()):
            raise ValueError(f"every ratio must be > 0 (got {ratios})")
        self.sources = sources
        self.labels = list(sources)
        total = sum(ratios[label] for label in self.labels)
        self.shares = {label: ratios[label] / total for label in self.labels}
        self._bounds = list(itertools.accumulate(self.shares[label] for label in self.labels))
        self.seed = seed
        # a string seed is hashed with SHA-512 (not Python's per-process hash): the same in every process
        self._offset = random.Random(f"gyre-mix:{seed}").random()
        self.cursors = {**(cursors or {})}
        for label in self.labels:
            self.cursors.setdefault(label, 0)
        self.draws = draws

    def pick(self, draw: int) -> str:
        """The entry of draw `draw`: a pure function of (seed, draw) and the ratios."""
        if len(self.labels) == 1:
            return self.labels[0]
        u = (self._offset + draw * PHI) % 1.0 * self._bounds[-1]
        return self.labels[min(bisect.bisect_right(self._bounds, u), len(self.labels) - 1)]

    def next(self, env: str | None = None) -> MixTask:
        """The next draw's entry and its next task; with `env`, that entry's next task outside the draw sequence (a
        dropped group's replacement that keeps its entry's share, advantage.refill = "entry"): the draws to come
        stay those of the sequence, and only that entry's cursor moves."""
        if env is not None:
            index = self.cursors[env]
            self.cursors[env] = index + 1
            return MixTask(env=env, index=index, draw=None, task=self.sources[env][index])
        draw = self.draws
        label = self.pick(draw)
        index = self.cursors[label]
        task = self.sources[label][index]
        self.cursors[label] = index + 1
        self.draws = draw + 1
        return MixTask(env=label, index=index, draw=draw, task=task)

    @property
    def index(self) -> int:
        """The single entry's cursor (one environment); with a mix, the first entry's."""
        return self.cursors[self.labels[0]]

    def state(self) -> tuple[dict[str, int], int]:
        """(cursors, draws) as a progress checkpoint saves them."""
        return dict(self.cursors), self.draws
