"""The torch engine's queue of sequences waiting for a batch row: by priority, then first come first served.

A request's `priority` (vLLM's field: lower is handled earlier, default 0) orders admission. The orchestrator
sends the RL step a rollout is for, so when more requests are in flight than the engine has rows, the oldest
batch's rollouts take the rows first and two batches' rollouts do not mix (with one priority for all, this is
plain first-come-first-served). A sequence keeps the place it got when it first arrived: one sent back (no blocks
for it yet, or preempted) goes in front of every later arrival of its priority, as before it was taken.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gyre_inference.batch import Sequence


class WaitingQueue:
    """Sequences waiting for a row, popped lowest (priority, arrival) first. Not thread-safe: the engine's
    condition lock guards it."""

    def __init__(self):
        self._heap: list[tuple[int, int, Sequence]] = []
        self._arrivals = itertools.count()
        self._live = 0  # entries not discarded: what len() and iteration see

    def append(self, seq: Sequence) -> None:
        """A new arrival, or one sent back (it keeps its first place: `Sequence.place`)."""
        if seq.place is None:
            seq.place = (seq.params.priority, next(self._arrivals))
        heapq.heappush(self._heap, (*seq.place, seq))
        seq.queued = True
        self._live += 1

    def discard(self, seq: Sequence) -> None:
        """`seq` (cancelled: its client went away) leaves the queue now: no longer counted (the waiting gauge,
        GetStatus) nor seen (an adapter slot it would have used is free), as vLLM drops an aborted request from its
        waiting queue. Its heap entry goes when it comes up (popleft may return it: the engine skips cancelled
        sequences). A sequence not queued is left alone."""
        if seq.queued:
            seq.queued = False
            self._live -= 1

    def extend(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self.append(seq)

    def popleft(self) -> Sequence:
        """The next sequence to admit (or a discarded one, whose entry came up first)."""
        seq = heapq.heappop(self._heap)[2]
        if seq.queued:
            seq.queued = False
            self._live -= 1
        return seq

    def clear(self) -> None:
        for _, _, seq in self._heap:
            seq.queued = False
        self._heap.clear()
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def __bool__(self) -> bool:
        return self._live > 0

    def __iter__(self) -> Iterator[Sequence]:
        """The sequences not discarded, in no particular order."""
        return (seq for _, _, seq in self._heap if seq.queued)
