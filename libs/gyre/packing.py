"""Bin packing of samples into rows, and of rows onto data-parallel ranks: the algorithm behind every
`TrainBatch` (`gyre.batch`), shared by the orchestrator (which packs real batches) and the trainer's bench.

- `first_fit_decreasing(lengths, capacity)`: rows of at most `capacity` tokens (the packing shape's
  `seq_len`, `gyre.config.packing`), longest sample first, each into the first row with room. At most
  11/9·OPT + 6/9 rows; for the few hundred samples of a step it is instant and within a row or two of
  optimal. A sample longer than a row is an error (the caller truncates or drops it first and counts it).
- `assign_to_ranks(rows, lengths, world_size)`: the same number of rows on every rank (FSDP ranks step in
  lock-step), similar token counts; rows holding several samples are split until the count divides evenly,
  and slots no row can fill are left empty for the caller to pad.
"""

from __future__ import annotations

from collections.abc import Sequence


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each summing to <= capacity; items visited longest first."""
    if capacity <= 0:
        raise ValueError("capacity must be positive")
    too_long = [i for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        raise ValueError(
            f"samples {too_long} are longer than seq_len={capacity} (more than the row capacity): truncate or drop "
            "them first"
        )
    if any(n <= 0 for n in lengths):
        raise ValueError("every sample must have at least one token")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def _split_bin(items: list[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    # greedy halving by tokens: each half is a subset of a bin that fit, so it fits too
    a: list[int] = []
    b: list[int] = []
    for i in sorted(items, key=lambda i: -lengths[i]):
        (a if sum(lengths[j] for j in a) <= sum(lengths[j] for j in b) else b).append(i)
    return a, b


def assign_to_ranks(bins: list[list[int]], lengths: Sequence[int], world_size: int) -> list[list[list[int]]]:
    """Distribute rows over ranks: equal row counts per rank, balanced tokens (largest row first).

    Rows with several samples are split until the row count is a multiple of `world_size`; slots that
    still lack a row (every row is a single sample) are returned as `[]` (the caller pads them).
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    bins = [list(b) for b in bins if b]

    def tokens(b: list[int]) -> int:
        return sum(lengths[i] for i in b)

    while len(bins) % world_size or not bins:
        splittable = [b for b in bins if len(b) >= 2]
        if not splittable:
            break
        victim = max(splittable, key=lambda b: (tokens(b), len(b)))
        bins.remove(victim)
        bins.extend(_split_bin(victim, lengths))
    while len(bins) % world_size or not bins:
        bins.append([])  # fewer samples than ranks: padding slots
    per_rank = len(bins) // world_size
    ranks: list[list[list[int]]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for b in sorted(bins, key=lambda b: -tokens(b)):
        r = min((r for r in range(world_size) if len(ranks[r]) < per_rank), key=lambda r: (load[r], r))
        ranks[r].append(b)
        load[r] += tokens(b)
    return ranks
