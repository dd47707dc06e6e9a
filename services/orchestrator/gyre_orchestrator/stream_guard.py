"""The orchestrator's watch over its batch stream: batches the trainer still needs must not leave it unnoticed.

A Redis server that came back empty (restarted without persistence), a stream deleted under a running server
(FLUSHALL, FLUSHDB, DEL, eviction by a `maxmemory-policy allkeys-*`), or a batch the trainer dead-lettered (e.g. its
spill file was lost): the trainer would wait forever for a batch that is gone, and the async bound would stall
generation behind it. Redis's `run_id` changes on every restart, the dead-letter stream's last id on every dead
letter, and the push count kept in Redis (`gyre:{run}:batches:pushed`) falls behind ours when keys are deleted; then
the stream is checked for the batches after the trainer's committed step, and if any is gone `StreamLost` makes
`gyre orchestrator` start over from the resume rule, which regenerates them. Also reported here: the dead letters
held and trimmed, and Redis's memory (a full Redis refuses the next push).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import redis
from gyre.streams import BatchStream, stream_id

from gyre_orchestrator.metrics import OrchestratorMetrics

log = logging.getLogger(__name__)

#: what `StreamGuard.marks` returns: Redis's run id, the newest dead letter's id, whether the stream was emptied,
#: whether it starts after the oldest of our pushes not trained yet
Marks = tuple[str, tuple[int, int] | None, bool, bool]


class StreamLost(RuntimeError):
    """Batches the trainer still needs left the stream; the orchestrator must start over from `step`.

    `rejected`: the trainer's reason when it dead-lettered them (None: Redis restarted without them)."""

    def __init__(self, message: str, step: int, rejected: str | None = None):
        super().__init__(message)
        self.step = step
        self.rejected = rejected


class StreamGuard:
    """What the orchestrator knows of its pushes, and the checks that tell when the stream lost some of them.

    `call(op, what, during_push=False)` is the service's Redis call that survives an outage (and a stop);
    `committed()` the trainer's committed step.
    """

    def __init__(self, client: redis.Redis, stream: BatchStream, metrics: OrchestratorMetrics,
                 call: Callable[..., Awaitable[Any]], committed: Callable[[], int]):  # fmt: skip
        self.redis, self.stream, self.metrics, self._call, self._committed = client, stream, metrics, call, committed
        # pushes counted in Redis too: a count that falls behind ours, or an INCR that skips, means the keys were
        # flushed under a running server (the next push recreates the stream, so its ids alone cannot tell)
        self.pushes_key = f"{stream.key}:pushed"
        self.pushes = 0
        self.pushes_reset = False
        self.pushed_id = (0, 0)  # stream id of our newest push
        self.untrained_ids: dict[int, tuple[int, int]] = {}  # step -> stream id, our pushes not trained yet
        self.seen: Marks = ("", None, False, False)  # `marks` when last checked
        self._eviction_warned = False  # Redis found evicting keys when full (warned once)

    async def start(self) -> None:
        """What a start finds: the push count kept in Redis and the marks every later check compares with."""
        self.pushes = int(await self._call(lambda: self.redis.get(self.pushes_key) or 0, "reading the push count"))
        self.seen = await self._call(self.marks, "checking the Redis server")

    async def pushed(self, step: int, entry_id: str) -> None:
        """Batch `step` was pushed as stream entry `entry_id`: count it in Redis too."""
        self.pushed_id = self.untrained_ids[step] = stream_id(entry_id)
        pushes = await self._call(lambda: self.redis.incr(self.pushes_key), "counting the push", during_push=True)
        self.pushes_reset |= pushes != self.pushes + 1  # (a retried push may count twice: a harmless check)
        self.pushes = pushes

    async def watch(self, last_step: Callable[[], int], interval_s: float = 5.0) -> None:
        """`check` every `interval_s` until it raises `StreamLost`."""
        while True:
            await asyncio.sleep(interval_s)
            await self.check(last_step())

    async def check(self, last_step: int) -> None:
        """StreamLost naming the first batch after the trainer's committed step, up to `last_step` (our newest push),
        that the stream no longer holds, when the marks changed since the last check."""
        marks = await self._call(self.marks, "checking the Redis server")
        if marks == self.seen:
            return
        restarted = marks[0] != self.seen[0]
        emptied = marks[2] or (marks[3] and marks[1] == self.seen[1])  # not dead-lettered meanwhile
        self.seen = marks
        self.pushes_reset = False
        committed = self._committed()
        have = set(await self._call(lambda: self.stream.steps_after(committed), "reading the stream"))
        missing = [s for s in range(committed + 1, last_step + 1) if s not in have]
        if missing:
            lost = restarted or emptied
            rejected = None if lost else await self._call(self._last_dead_reason, "reading the dead letters")
            why = (
                "Redis restarted without" if restarted
                else "the stream was emptied (flushed, deleted or evicted) of" if emptied
                else f"the trainer dead-lettered ({rejected})"
            )  # fmt: skip
            raise StreamLost(
                f"{why} the batches of steps {missing} (pushed, not yet trained): starting over from step {missing[0]}",
                missing[0],
                rejected,
            )
        if restarted:
            log.info("Redis restarted; the stream still holds every batch the trainer needs")

    def marks(self) -> Marks:
        """Redis's `run_id` (new on every restart), the last id of the dead-letter stream (None: none yet),
        whether the batches stream was emptied since our newest push (deleted, flushed or evicted), and whether
        it starts after the oldest of our pushes not trained yet (deleted, then pushed to again before this
        check; or that entry dead-lettered, which the dead letters' id tells apart)."""
        run_id = self.redis.info("server")["run_id"]
        first, last = self._stream_ids(self._stream_info(self.stream.key))
        dead_info = self._stream_info(self.stream.dead_key)
        _, dead = self._stream_ids(dead_info)
        self._note_dead_letters(dead_info)
        emptied = (
            self.pushes_reset  # FLUSHALL / FLUSHDB, then a push
            or int(self.redis.get(self.pushes_key) or 0) < self.pushes  # FLUSHALL / FLUSHDB
            or (last or (0, 0)) < self.pushed_id  # the stream alone deleted or evicted
        )
        committed = self._committed()
        self.untrained_ids = {step: id_ for step, id_ in self.untrained_ids.items() if step > committed}
        oldest = min(self.untrained_ids.values(), default=None)
        return run_id, dead, emptied, oldest is not None and (first is None or first > oldest)

    def note_redis_memory(self) -> None:
        """Redis's used memory and maxmemory (0 = none): past maxmemory the next push is refused (the chart sets it
        with noeviction), so `GyreRedisMemoryHigh` warns before. A Redis that refuses INFO is left unmeasured."""
        try:
            info = self.redis.info("memory")
        except redis.ResponseError:
            return
        for state, key in (("used", "used_memory"), ("max", "maxmemory")):
            self.metrics.labels(self.metrics.redis_memory, state=state).set(float(info.get(key, 0)))
        policy = info.get("maxmemory_policy", "noeviction")
        if info.get("maxmemory", 0) and policy != "noeviction" and not self._eviction_warned:
            self._eviction_warned = True
            log.warning(
                "redis evicts keys when it reaches maxmemory (maxmemory-policy %s): full, it would delete batch "
                "streams (their steps generated again, the work lost); set maxmemory-policy noeviction "
                "(docs/kubernetes.md, 'Redis memory')",
                policy,
            )

    def _stream_info(self, key: str) -> dict | None:
        """XINFO STREAM of `key` (None: no such key)."""
        try:
            return self.redis.xinfo_stream(key)
        except redis.ResponseError:
            return None

    @staticmethod
    def _stream_ids(info: dict | None) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """The ids (`ms-seq` as Redis orders them) of a stream's first entry (None: empty) and the last one ever
        added (None: no such key), from its XINFO STREAM `info`."""
        if info is None:
            return None, None
        first = info["first-entry"][0].decode() if info.get("first-entry") else None
        return stream_id(first) if first else None, stream_id(info["last-generated-id"].decode())

    def _note_dead_letters(self, info: dict | None) -> None:
        """`gyre_orchestrator_dead_letters`: the dead letters held, and those trimmed (the trainer keeps the newest
        `intake.dead_letter_maxlen`, and counts the others in `gyre:{run}:batches:dead:trimmed`)."""
        self.metrics.labels(self.metrics.dead_letters, state="held").set(int(info["length"]) if info else 0)
        self.metrics.labels(self.metrics.dead_letters, state="trimmed").set(self.stream.dead_trimmed())

    def _last_dead_reason(self) -> str:
        newest = self.redis.xrevrange(self.stream.dead_key, count=1)
        reason = newest[0][1].get(b"reason", b"no reason given") if newest else b"no reason given"
        return reason.decode(errors="replace")
