"""Scoring a sample again when its judge, reward model or teacher failed: the same completion, never a new one.

A `ScoringError` or `EndpointError` (a signal down, timing out or answering 5xx past its own `retries`) made the
sample be generated again, so a completion whose scoring failed was never trained on: the samples a judge struggles
with (long ones, odd ones) left the batch, a bias nobody saw. Now the same completion is scored again, after a
backoff, `attempts` times in all; when every attempt fails, `ScoringFailed` stops the run (training, or the
evaluation in `gyre eval` and the training loop's evals) with the signal's reason, never a silent drop or a reward
of 0. (verifiers' Rubric logs a reward function's exception, its JudgeRubric's API errors included, and scores it 0:
a judge down for a while trained on zeros. Gyre keeps its rule that a signal's failure is no reward.)
A completion a signal refuses to grade (a request refused for what it holds) is another matter: `Unjudged`, 0 for
that function, counted (docs/environments.md, "Judges and reward models").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from gyre.endpoint import EndpointError
from gyre.envs import ScoringError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: the wait before the second attempt; it doubles before each further one
RESCORE_BACKOFF_S = 1.0


class ScoringFailed(RuntimeError):
    """A completion's scoring failed on every attempt: the run stops with the reason (not generated again)."""


async def scored_again(
    score: Callable[[], Awaitable[T]],
    *,
    attempts: int,
    what: str,
    on_failure: Callable[[BaseException], None] = lambda _error: None,
    backoff_s: float = RESCORE_BACKOFF_S,
) -> T:
    """`score()`, called again on a `ScoringError` / `EndpointError` after `backoff_s` (doubling), `attempts` times
    at most; `on_failure` hears of each failure (the orchestrator's `scoring_failures`). `what` names the sample in
    the log and in `ScoringFailed`."""
    for attempt in range(1, attempts + 1):
        try:
            return await score()
        except (ScoringError, EndpointError) as error:
            on_failure(error)
            if not getattr(error, "rescorable", True):  # scored inside its episode (verifiers): the caller generates
                raise  # the sample again
            if attempt == attempts:
                raise ScoringFailed(f"{what}: scoring failed {attempts} times on the same completion "
                                    f"(sample_attempts = {attempts}): {error}") from error  # fmt: skip
            delay = backoff_s * 2 ** (attempt - 1)
            log.warning("%s: scoring failed (%s); scoring the same completion again in %.1fs (attempt %d of %d)",
                        what, error, delay, attempt + 1, attempts)  # fmt: skip
            await asyncio.sleep(delay)
    raise AssertionError("unreachable: attempts >= 1")
