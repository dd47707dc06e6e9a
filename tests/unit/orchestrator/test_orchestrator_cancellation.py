"""A cancel that lands just as what a task waits for completes is still a cancel.

CI saw `WeightRelay.stop()` hang for good: its loop waited on its wake event with `asyncio.wait_for`, and on Python
3.11 a wait_for cancelled in the loop iterations between the event being set and the waiting task resuming returns
normally; the cancellation is lost, the loop goes round again, and `stop()` waits for it for ever. A replica
update that had just finished (it wakes the loop) right before the orchestrator stopped was enough. The same
wait_for let a cancelled `ReplicaSet.acquire` hand out a replica (its in-flight count never released) and a cancelled
tool call return its result. Each case is tried at every loop iteration of that window.
"""

from __future__ import annotations

import asyncio

import pytest
from gyre.envs.tools import Tool
from gyre.transport import FolderStore
from gyre_orchestrator.relay import WeightRelay
from gyre_orchestrator.replicas import Endpoint, ReplicaSet
from gyre_orchestrator.scheduler import VersionWatch

WINDOW = range(6)  # loop iterations between the wake-up and the cancel: the window is 1-3 of them on 3.11


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.mark.parametrize("turns", WINDOW)
def test_the_relay_stops_when_a_wake_up_lands_just_before_stop(tmp_path, turns):
    async def scenario():
        relay = WeightRelay(ReplicaSet(), FolderStore(tmp_path / "store"), VersionWatch(0),
                            probe_interval_s=600.0, poll_store_s=600.0)  # fmt: skip
        await relay.start()
        await _turns(3)  # the loop is waiting on its wake event
        relay._wake.set()  # what a replica's mark_ok or a notification does
        await _turns(turns)
        stopping = asyncio.create_task(relay.stop())
        done, _ = await asyncio.wait([stopping], timeout=5)
        assert done, f"stop() still waiting 5 s after a wake-up {turns} loop turns before it"

    asyncio.run(scenario())


@pytest.mark.parametrize("turns", WINDOW)
def test_a_cancelled_acquire_takes_no_replica(turns):
    async def scenario():
        replicas = ReplicaSet([Endpoint("http://a:1", "a:2")])
        replica = replicas.replicas["http://a:1"]
        waiting = asyncio.create_task(replicas.acquire(min_version=2))  # nothing serves version 2 yet
        await _turns(3)
        replicas.mark_ok(replica, 2)  # it does now: the waiter is woken
        await _turns(turns)
        if waiting.done():  # it took the replica before the cancel: the caller has it and releases it
            return "acquired", replica.inflight
        waiting.cancel()
        try:
            await waiting
        except asyncio.CancelledError:
            return "cancelled", replica.inflight
        return "lost the cancel", replica.inflight

    outcome, inflight = asyncio.run(scenario())
    # a lost cancel hands the replica to a caller that is gone: its request is never released
    assert outcome != "lost the cancel" and inflight == (1 if outcome == "acquired" else 0), (outcome, inflight)


@pytest.mark.parametrize("turns", WINDOW)
def test_a_cancelled_tool_call_is_cancelled(turns):
    async def scenario():
        finish = asyncio.Event()

        async def lookup(city: str) -> str:
            """Look a city up."""
            await finish.wait()
            return f"{city}: sunny"

        call = asyncio.create_task(Tool.from_function(lookup).call({"city": "Oslo"}, timeout=60))
        await _turns(3)
        finish.set()
        await _turns(turns)
        if call.done():  # it finished before the cancel: nothing to lose
            return "finished"
        call.cancel()
        try:
            await call
        except asyncio.CancelledError:
            return "cancelled"
        return "lost the cancel"

    assert asyncio.run(scenario()) != "lost the cancel"
