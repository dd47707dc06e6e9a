"""Task sources and splits: how an environment's tasks are addressed by index and split into train and eval.

Every source is a pure function of its index (given the environment's args, split and seed), so a sampler checkpoints
one index and resumes exactly. `gyre.envs.base` (environments), `gyre.envs.rows` (a dataset's rows) and the verifiers
adapter share these.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from functools import lru_cache

from gyre.envs.types import Task

# Attempts to draw a train task that is not in the eval split before giving up (task space too small).
MAX_REDRAWS = 100


class TaskSource:
    """The tasks of one split, addressable by index: `source[i]` is a pure function of (environment args, split,
    seed, i), so a sampler can checkpoint just an index and resume exactly. `size` is None for an endless split.
    """

    def __init__(self, make: Callable[[int], Task], size: int | None) -> None:
        self._make = make
        self.size = size

    def __getitem__(self, index: int) -> Task:
        if index < 0 or (self.size is not None and index >= self.size):
            raise IndexError(f"task index {index} out of range (size {self.size})")
        return self._make(index)

    def __len__(self) -> int:
        if self.size is None:
            raise TypeError("this task source is endless; use .size (None) or iterate")
        return self.size

    def __iter__(self) -> Iterator[Task]:
        return self.iter_from(0)

    def iter_from(self, start: int) -> Iterator[Task]:
        index = start
        while self.size is None or index < self.size:
            yield self._make(index)
            index += 1


def distinct_tasks(
    draw: Callable[[int, str], Task], count: int, name: str, key: Callable[[Task], str] = lambda task: task.key
) -> list[Task]:
    """The eval split: `draw(i, task_id)` for i = 0, 1, ... until `count` tasks with distinct `key`s (a repeat is
    skipped); ValueError naming the environment after `count * MAX_REDRAWS` draws."""
    tasks: list[Task] = []
    seen: set[str] = set()
    for index in range(count * MAX_REDRAWS):
        task = draw(index, f"eval-{len(tasks)}")
        if key(task) not in seen:
            seen.add(key(task))
            tasks.append(task)
            if len(tasks) == count:
                return tasks
    # a game asking one question of every task (its secret in the answer) read as "lower num_eval", whatever it was
    raise ValueError(f"{name}: could not draw {count} distinct eval tasks: {count * MAX_REDRAWS} draws gave only "
                     f"{len(tasks)} distinct ones; lower num_eval. Tasks are told apart by their prompt: an "
                     "environment whose prompt is the same for every task (a secret in the answer or info) "
                     "overrides task_key(task), e.g. return task.key + task.answer")  # fmt: skip


def hold_out(items: list, num_eval: int, salt: str) -> tuple[list, list]:
    """(train, eval): `num_eval` of `items` held out for eval, chosen by a seed (`salt`), order kept."""
    held = set(random.Random(salt).sample(range(len(items)), num_eval))
    return [t for i, t in enumerate(items) if i not in held], [t for i, t in enumerate(items) if i in held]


def epoch_order(n: int, salt: str) -> Callable[[int], int]:
    """Endless index -> item of `n` items: epoch `e` visits each once, in an order seeded by (`salt`, `e`).

    A pure function of the index, so a sampler that checkpoints only its index resumes exactly.
    """
    if n < 1:
        raise ValueError("epoch_order needs at least one item")

    @lru_cache(maxsize=4)
    def order(epoch: int) -> list[int]:
        indices = list(range(n))
        random.Random(f"{salt}/{epoch}").shuffle(indices)
        return indices

    return lambda index: order(index // n)[index % n]


def listed_tasks(train: list[Task], evals: list[Task], split: str, seed: int, salt: str) -> TaskSource:
    """The `split` of tasks held in lists: eval = `evals` in order; train = `train` endlessly, each epoch in
    an order seeded by (`salt`, `seed`)."""
    if split == "eval":
        return TaskSource(evals.__getitem__, len(evals))
    if split != "train":
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    order = epoch_order(len(train), f"{salt}/train/{seed}")
    return TaskSource(lambda index: train[order(index)], None)
