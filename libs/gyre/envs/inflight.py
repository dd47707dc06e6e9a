"""One request per key while it is on its way, shared by every caller that asks the same (a judge's verdict read by
n rollouts with the same reply, or by several reward functions of one rollout).

The request runs in a task of its own, not in the first caller's: a caller that is cancelled (its rollout dropped,
its group skipped) leaves the request to the others, who get its answer (or its error) as if they had asked. It is
cancelled when the last caller waiting for it is, and then forgotten at once, so a later caller asks again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Any


class _Entry:
    __slots__ = ("task", "waiting")

    def __init__(self, task: asyncio.Future) -> None:
        self.task = task
        self.waiting = 0


class InFlight:
    """Requests in flight by key (module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, _Entry] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    async def share(self, key: Hashable, ask: Callable[[], Awaitable[Any]]) -> Any:
        """The answer of the request in flight for `key`, or of `ask()` started now when there is none."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(asyncio.ensure_future(ask()))
            entry.task.add_done_callback(lambda task, key=key, entry=entry: self._settled(key, entry, task))
        entry.waiting += 1
        try:
            return await asyncio.shield(entry.task)
        finally:
            entry.waiting -= 1
            if not entry.waiting and not entry.task.done():  # nobody waits for it any more
                self._forget(key, entry)  # before it ends: a caller arriving meanwhile must not join a cancelled one
                entry.task.cancel()

    def _forget(self, key: Hashable, entry: _Entry) -> None:
        if self._entries.get(key) is entry:
            del self._entries[key]

    def _settled(self, key: Hashable, entry: _Entry, task: asyncio.Future) -> None:
        self._forget(key, entry)
        if not task.cancelled():
            task.exception()  # retrieved: its callers raised it, and none may be left to
