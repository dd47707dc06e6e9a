"""Rubric: a weighted sum of reward functions, each reported on its own.

A reward function is a plain (sync or async) function that declares, by parameter name, what it needs:

    completion  messages after the prompt (assistant / user / tool turns)
    prompt      the task's opening messages
    messages    prompt + completion
    answer      the task's reference answer (str)
    task        the Task
    info        task.info
    state       the rollout's state dict (what the environment recorded while running)
    rollout     the Rollout itself
    parser      the rubric's parser

e.g. `def exact(completion, answer, parser) -> float`. A `**kwargs` parameter receives all of them. It returns
a number (bools count as 0/1). Sync functions run inline on the event loop, so keep them fast (or make them
async and offload). A function that raises or returns something non-finite scores 0.0 and is named in
`Score.errors`; scoring itself never raises on model output. The exception is `ScoringError`: a function that
could not score for a reason outside the rollout (a judge or reward model that failed after its retries,
`gyre.envs.judge`) raises it, and it goes through to the caller, which scores again; a failed judge is never a 0.
(A judge that refuses this one rollout, e.g. longer than its context, raises `gyre.envs.judge.Unjudged` instead:
an ordinary error, 0 for that function, named in `Score.errors`; asking again would be refused again.)
Functions run concurrently (a judge and a reward model wait on the network together).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable

from gyre.envs.parsers import Parser
from gyre.envs.types import Rollout, Score, ScoringError, Task

RewardFunc = Callable[..., float | Awaitable[float]]
ARGUMENTS = ("completion", "prompt", "messages", "answer", "task", "info", "state", "rollout", "parser")


class Rubric:
    """Weighted reward functions; `await rubric.score(task, rollout)` -> `Score`."""

    def __init__(
        self, funcs: list[RewardFunc] | None = None, weights: list[float] | None = None, parser: Parser | None = None
    ) -> None:
        self.parser = parser or Parser()
        self.funcs: list[RewardFunc] = []
        self.weights: list[float] = []
        self.names: list[str] = []
        self._wants: list[list[str] | None] = []  # argument names each function takes (None = all, **kwargs)
        funcs = funcs or []
        if weights is not None and len(weights) != len(funcs):
            raise ValueError(f"{len(funcs)} reward functions but {len(weights)} weights")
        for func, weight in zip(funcs, weights or [1.0] * len(funcs), strict=True):
            self.add(func, weight)

    def add(self, func: RewardFunc, weight: float = 1.0, name: str | None = None) -> Rubric:
        """Register a reward function (its name defaults to `func.__name__` and must be unique)."""
        name = name or getattr(func, "__name__", type(func).__name__)
        if name in self.names:
            raise ValueError(f"reward function {name!r} is already in this rubric")
        if not math.isfinite(weight):
            raise ValueError(f"weight of {name!r} must be finite, got {weight}")
        params = list(inspect.signature(func).parameters.values())
        for p in params:
            if p.kind is p.VAR_KEYWORD or p.default is not p.empty:
                continue
            if p.kind is p.VAR_POSITIONAL or p.name not in ARGUMENTS:
                raise ValueError(f"reward function {name!r}: parameter {p.name!r} is not one of {ARGUMENTS}")
        self.funcs.append(func)
        self.weights.append(float(weight))
        self.names.append(name)
        self._wants.append(None if any(p.kind is p.VAR_KEYWORD for p in params) else [p.name for p in params])
        return self

    async def score(self, task: Task, rollout: Rollout) -> Score:
        available = {
            "completion": rollout.completion,
            "prompt": rollout.prompt,
            "messages": rollout.messages,
            "answer": task.answer,
            "task": task,
            "info": task.info,
            "state": rollout.state,
            "rollout": rollout,
            "parser": self.parser,
        }
        errors: dict[str, str] = {}

        async def one(func: RewardFunc, name: str, wants: list[str] | None) -> float:
            kwargs = available if wants is None else {arg: available[arg] for arg in wants if arg in available}
            try:
                value = func(**kwargs)
                if inspect.isawaitable(value):
                    value = await value
                value = float(value)
                if not math.isfinite(value):
                    raise ValueError(f"returned {value}")
            except ScoringError:
                raise  # not the rollout's fault: scored again by the caller, never a silent 0
            except Exception as exc:  # a reward bug must not take the rollout (or the step) down with it
                errors[name] = f"{type(exc).__name__}: {exc}"
                value = 0.0
            return value

        values = await asyncio.gather(
            *(one(func, name, wants) for func, name, wants in zip(self.funcs, self.names, self._wants, strict=True))
        )
        per_function = dict(zip(self.names, values, strict=True))
        reward = sum(weight * value for weight, value in zip(self.weights, values, strict=True))
        return Score(reward=reward, per_function=per_function, errors=errors)
