"""Rubric: a weighted sum of reward functions, each reported on its own.

A reward function is a plain (sync or async) function that declares, by parameter name, what it needs:

    completion  messages after the prompt (assistant / user / tool turns)
    prompt      the task's opening messages
    messages    prompt + completion
    answer      the task's reference answer (str)
    task        the task's name, as verifiers passes it: the row's `task` column (`task.info["task"]`), else
                "default"; a `str` (so `task == "math"` holds) that also reads as the Task (`task.answer`,
                `task.info`, `task.id`, `task.prompt`, `task.key`)
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
(A judge that refuses this one rollout, e.g. longer than its context, raises `gyre.envs.judge_prompt.Unjudged` instead:
an ordinary error, 0 for that function, named in `Score.errors`; asking again would be refused again.)
Functions run concurrently (a judge and a reward model wait on the network together). An async function that has
not finished after `timeout_s` (default `REWARD_TIMEOUT_S`, per function with `add(..., timeout_s=)`; None = no
bound) raises `ScoringError`: an awaited call with no deadline of its own hung the rollout, and with it the step,
for ever. Judges and reward models have their own per-request deadlines and retries and wait on their concurrency
bound, so they are added without one. A sync function cannot be stopped midway: keep it fast.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Awaitable, Callable

from gyre.envs.parsers import Parser
from gyre.envs.types import Rollout, Score, ScoringError, Task

RewardFunc = Callable[..., float | Awaitable[float]]
ARGUMENTS = ("completion", "prompt", "messages", "answer", "task", "info", "state", "rollout", "parser")
# Seconds an async reward function may take (see the module docstring): far past any healthy network call.
REWARD_TIMEOUT_S = 600.0
# The `task` argument of a task without a `task` entry in its info: verifiers' name for a dataset without that column
DEFAULT_TASK_NAME = "default"
_DEFAULT: float = -1.0  # `add`'s timeout_s when not given: the rubric's own


class Rubric:
    """Weighted reward functions; `await rubric.score(task, rollout)` -> `Score`."""

    def __init__(
        self,
        funcs: list[RewardFunc] | None = None,
        weights: list[float] | None = None,
        parser: Parser | None = None,
        timeout_s: float | None = REWARD_TIMEOUT_S,
    ) -> None:
        self.parser = parser or Parser()
        #: more arguments its reward functions may take by name (verifiers' `class_objects`: a `JudgeRubric`'s
        #: `judge`); a subclass sets them before calling this
        self.class_objects: dict[str, object] = dict(getattr(self, "class_objects", {}))
        self.timeout_s = _checked_timeout(timeout_s)
        self._timeouts: list[float | None] = []
        self.funcs: list[RewardFunc] = []
        self.weights: list[float] = []
        self.names: list[str] = []
        self._wants: list[list[str] | None] = []  # argument names each function takes (None = all, **kwargs)
        funcs = funcs or []
        if weights is not None and len(weights) != len(funcs):
            raise ValueError(f"{len(funcs)} reward functions but {len(weights)} weights")
        for func, weight in zip(funcs, weights or [1.0] * len(funcs), strict=True):
            self.add(func, weight)

    def add(
        self, func: RewardFunc, weight: float = 1.0, name: str | None = None, timeout_s: float | None = _DEFAULT
    ) -> Rubric:
        """Register a reward function (its name defaults to `func.__name__` and must be unique); `timeout_s` bounds
        an async one (default: the rubric's `timeout_s`; None: unbounded)."""
        # a functools.partial has no __name__: it was named "partial" (two of them: "already in this rubric")
        name = name or getattr(getattr(func, "func", func), "__name__", type(func).__name__)
        if name in self.names:
            raise ValueError(f"reward function {name!r} is already in this rubric: give this one its own name, "
                             f"rubric.add(func, weight, name=...)")  # fmt: skip
        # a weight from a config file as text ("0.5") or a bool was a TypeError that named nothing, or a weight of 1
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ValueError(f"weight of {name!r} must be a finite number, got {weight!r}")
        params = list(inspect.signature(func).parameters.values())
        for p in params:
            if p.kind is p.VAR_KEYWORD or p.default is not p.empty:
                continue
            if p.kind is p.VAR_POSITIONAL or (p.name not in ARGUMENTS and p.name not in self.class_objects):
                known = (*ARGUMENTS, *self.class_objects)
                raise ValueError(f"reward function {name!r}: parameter {p.name!r} is not one of {known}")
        self.funcs.append(func)
        self._timeouts.append(self.timeout_s if timeout_s == _DEFAULT else _checked_timeout(timeout_s))
        self.weights.append(float(weight))
        self.names.append(name)
        self._wants.append(None if any(p.kind is p.VAR_KEYWORD for p in params) else [p.name for p in params])
        return self

    def add_reward_func(self, func: RewardFunc, weight: float = 1.0) -> Rubric:
        """verifiers' name for `add` (`rubric.add_reward_func(f, weight=0.5)`): a rubric ported from verifiers was an
        AttributeError at load."""
        return self.add(func, weight)

    def add_metric(self, func: RewardFunc) -> Rubric:
        """verifiers' metric: a function reported on its own (`per_function`, the dumps) that adds nothing to the
        reward (weight 0)."""
        return self.add(func, 0.0)

    def judges(self) -> dict[str, object]:
        """The judges and reward models this rubric asks, by name (each has `endpoint`, `stats`, `aclose`): those
        added as reward functions (`rubric.add(Judge(...))`, `[[orchestrator.judges]]`) and a subclass's own (a
        `JudgeRubric`'s judge). The orchestrator and `gyre eval` wait for their servers before the first rollout and
        report their counters (step lines' `signals`, `gyre_orchestrator_signal_calls_total`) as for
        `[[orchestrator.judges]]`: a judge built in the environment's code was neither waited for nor counted."""
        # by their marker: gyre.envs.judge imports this module, and modules of a package never import each other
        return {name: func for func, name in zip(self.funcs, self.names, strict=True)
                if getattr(func, "asks_a_served_model", False) is True}  # fmt: skip

    async def score(self, task: Task, rollout: Rollout) -> Score:
        available = {
            "completion": rollout.completion,
            "prompt": rollout.prompt,
            "messages": rollout.messages,
            "answer": task.answer,
            "task": TaskName.of(task),
            "info": task.info,
            "state": rollout.state,
            "rollout": rollout,
            "parser": self.parser,
            **{key: value for key, value in self.class_objects.items() if key not in ARGUMENTS},
        }
        errors: dict[str, str] = {}

        async def one(func: RewardFunc, name: str, wants: list[str] | None, timeout: float | None) -> float:
            kwargs = available if wants is None else {arg: available[arg] for arg in wants if arg in available}
            try:
                value = func(**kwargs)
                if inspect.isawaitable(value):
                    deadline = asyncio.timeout(timeout)
                    try:
                        async with deadline:
                            value = await value
                    except TimeoutError:
                        if not deadline.expired():  # the function's own TimeoutError: an ordinary error
                            raise
                        raise ScoringError(
                            f"reward function {name!r} did not finish within {timeout:g}s (Rubric timeout_s)"
                        ) from None
                value = float(value)
                if not math.isfinite(value):
                    raise ValueError(f"returned {value}")
            except ScoringError:
                raise  # not the rollout's fault: scored again by the caller, never a silent 0
            except Exception as exc:  # a reward bug must not take the rollout (or the step) down with it
                errors[name] = f"{type(exc).__name__}: {exc}"
                value = 0.0
            return value

        calls = [
            asyncio.ensure_future(one(func, name, wants, timeout))
            for func, name, wants, timeout in zip(self.funcs, self.names, self._wants, self._timeouts, strict=True)
        ]
        try:
            values = await asyncio.gather(*calls)
        except BaseException:  # a ScoringError: the others' work (a judge's request) is for a score never used
            for call in calls:
                call.cancel()
            raise
        per_function = dict(zip(self.names, values, strict=True))
        reward = sum(weight * value for weight, value in zip(self.weights, values, strict=True))
        return Score(reward=reward, per_function=per_function, errors=errors)


class RubricGroup(Rubric):
    """Several rubrics scored as one (verifiers' `RubricGroup`): the reward is the sum of theirs, `per_function` and
    `errors` hold every function of each, and each function gets its own rubric's `parser`. Function names must be
    unique across the group (each is reported on its own). Functions added to the group itself (`add`: a judge
    joined from the run's config) are scored with the first rubric's parser."""

    def __init__(self, rubrics: list[Rubric], timeout_s: float | None = REWARD_TIMEOUT_S) -> None:
        if not rubrics or not all(isinstance(r, Rubric) for r in rubrics):
            raise ValueError(f"RubricGroup takes a non-empty list of Rubrics, got {rubrics!r}")
        self.rubrics = list(rubrics)
        super().__init__(parser=self.rubrics[0].parser, timeout_s=timeout_s)
        seen: set[str] = set()
        for name in (name for rubric in self.rubrics for name in rubric.names):
            if name in seen:
                raise ValueError(f"RubricGroup: reward function {name!r} is in two of its rubrics; give one its own "
                                 f"name (rubric.add(func, weight, name=...))")  # fmt: skip
            seen.add(name)

    def add(self, func: RewardFunc, weight: float = 1.0, name: str | None = None,
            timeout_s: float | None = _DEFAULT) -> Rubric:  # fmt: skip
        taken = {n for rubric in self.rubrics for n in rubric.names}
        resolved = name or getattr(getattr(func, "func", func), "__name__", type(func).__name__)
        if resolved in taken:
            raise ValueError(f"reward function {resolved!r} is already in this RubricGroup: give this one its own "
                             f"name, rubric.add(func, weight, name=...)")  # fmt: skip
        return super().add(func, weight, name, timeout_s)

    def judges(self) -> dict[str, object]:
        found = {}
        for rubric in [*self.rubrics, super()]:  # each rubric's, then the group's own (a configured judge)
            found.update({name: judge for name, judge in rubric.judges().items() if judge not in found.values()})
        return found

    async def score(self, task: Task, rollout: Rollout) -> Score:
        own = [super().score(task, rollout)] if self.funcs else []
        calls = [asyncio.ensure_future(c) for c in [*(r.score(task, rollout) for r in self.rubrics), *own]]
        try:
            scores = await asyncio.gather(*calls)
        except BaseException:  # a ScoringError in one: the others' work is for a score never used
            for call in calls:
                call.cancel()
            raise
        return Score(reward=sum(s.reward for s in scores),
                     per_function={k: v for s in scores for k, v in s.per_function.items()},
                     errors={k: v for s in scores for k, v in s.errors.items()})  # fmt: skip


class MathRubric(Rubric):
    """verifiers' `MathRubric`: `correct_answer_reward_func`, 1.0 when math-verify finds the parsed reply equal to
    the answer (`gyre.envs.scoring.math_equal`), plus any `funcs` given. Its parser defaults to reasoning dropped and
    the last `\\boxed{}` read (`Parser(extract_fn=extract_boxed_answer)`), as there."""

    def __init__(self, funcs: list[RewardFunc] | None = None, weights: list[float] | None = None,
                 parser: Parser | None = None, timeout_s: float | None = REWARD_TIMEOUT_S) -> None:  # fmt: skip
        from gyre.envs.parsers import extract_boxed_answer

        super().__init__(funcs, weights, parser or Parser(extract_fn=extract_boxed_answer), timeout_s)
        self.add(correct_answer_reward_func)


def correct_answer_reward_func(completion, answer, parser) -> float:
    """1.0 when math-verify finds the parsed reply equal to the reference answer (MathRubric's reward)."""
    from gyre.envs.scoring import math_equal  # math-verify (sympy) is heavy: imported when a math rubric scores

    return float(math_equal(parser.parse_answer(completion), answer))


class TaskName(str):
    """The `task` argument: the task's name as verifiers gives its reward functions (a dataset's `task` column, a
    string; "default" without one), which also reads as the Gyre `Task` it names. A verifiers reward that branches
    on `task == "math"` got the Task object here, never equal to a string: that branch was silently never taken. A
    Gyre reward written against the Task (`task.info`, `task.answer`) keeps working: a name `str` lacks is the
    Task's."""

    task: Task

    @classmethod
    def of(cls, task: Task) -> TaskName:
        name = task.info.get("task")
        self = cls(name if isinstance(name, str) and name else DEFAULT_TASK_NAME)
        self.task = task
        return self

    def __getattr__(self, name: str):  # only names `str` does not have: the Task's fields and `key`
        # not `task` before it is set (no recursion), nor a protocol name (`__deepcopy__`, `__dataclass_fields__`):
        # copy, pickle and introspection see a str, never the Task's
        if name == "task" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.task, name)

    def __reduce__(self):  # a copy or pickle is the plain name (a str), never a half-built TaskName
        return (str, (str(self),))


def _checked_timeout(timeout_s: float | None) -> float | None:
    if timeout_s is not None and not (isinstance(timeout_s, int | float) and 0 < timeout_s < math.inf):
        raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
    return timeout_s
