"""`gyre.envs.inflight.InFlight`: one request per key while it is on its way, shared by every caller (a judge's
verdict read by n rollouts, or by several reward functions of one rollout). Pure asyncio, no server."""

from __future__ import annotations

import asyncio

import pytest
from gyre.envs.inflight import InFlight


class Asked:
    """A request that answers when released, counting how often it was started and cancelled."""

    def __init__(self) -> None:
        self.started = 0
        self.cancelled = 0
        self.release = asyncio.Event()

    async def __call__(self, answer="answer"):
        self.started += 1
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if isinstance(answer, BaseException):
            raise answer
        return answer


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_callers_of_one_key_share_one_request_and_other_keys_ask_their_own():
    inflight, asked = InFlight(), Asked()
    callers = [asyncio.create_task(inflight.share(key, lambda key=key: asked(key))) for key in ("a", "a", "a", "b")]
    await _settle()
    assert asked.started == 2 and "a" in inflight and "b" in inflight
    asked.release.set()
    assert await asyncio.gather(*callers) == ["a", "a", "a", "b"]
    assert "a" not in inflight and "b" not in inflight  # settled requests are forgotten: the next call asks again
    assert await inflight.share("a", lambda: asked("again")) == "again" and asked.started == 3


@pytest.mark.asyncio
async def test_the_first_caller_cancelled_leaves_the_request_to_the_others():
    inflight, asked = InFlight(), Asked()
    first = asyncio.create_task(inflight.share("k", asked))
    await _settle()
    second = asyncio.create_task(inflight.share("k", asked))
    await _settle()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    asked.release.set()
    assert await second == "answer"
    assert asked.started == 1 and asked.cancelled == 0


@pytest.mark.asyncio
async def test_a_request_nobody_waits_for_is_cancelled_and_a_later_caller_asks_anew():
    inflight, asked = InFlight(), Asked()
    callers = [asyncio.create_task(inflight.share("k", asked)) for _ in range(2)]
    await _settle()
    for caller in callers:
        caller.cancel()
    await asyncio.gather(*callers, return_exceptions=True)
    assert "k" not in inflight  # forgotten at once, before its task has ended
    later = asyncio.create_task(inflight.share("k", asked))  # must not join the cancelled request
    await _settle()
    assert asked.cancelled == 1 and asked.started == 2
    asked.release.set()
    assert await later == "answer"


@pytest.mark.asyncio
async def test_an_error_reaches_every_caller_and_is_not_kept():
    inflight, asked = InFlight(), Asked()
    callers = [asyncio.create_task(inflight.share("k", lambda: asked(ValueError("down")))) for _ in range(3)]
    await _settle()
    asked.release.set()
    results = await asyncio.gather(*callers, return_exceptions=True)
    assert [type(r) for r in results] == [ValueError] * 3 and asked.started == 1
    assert "k" not in inflight
