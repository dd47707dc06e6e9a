"""Retrying Redis calls through an outage: exponential backoff, an optional deadline, prompt stop.

Only connection-level failures are retried (`redis.ConnectionError`, which includes a server still
loading its append-only file, and `redis.TimeoutError`), and a write Redis refused at `maxmemory` with
`noeviction` (`redis.OutOfMemoryError`: nothing was written; room comes back as the trainer acks batches
and a push trims them, `BatchStream.trim_trained`); a wrong command or type fails at once, and so
does a refused password: redis-py's `AuthenticationError` is a `ConnectionError`, but no wait mends a
wrong `redis.password`, so it raises `RedisAuthenticationFailed` naming the key instead of retrying.
Callers retry only operations that are safe to repeat after an unknown outcome: reads, acks, and
XADD of a batch (a duplicate entry of a step is acked and skipped by the trainer's StepReader).

- `call_with_retry` (threads, the trainer's intake): sleeps in short slices and raises `Stopped`
  as soon as `should_stop()` is true, so SIGTERM is honoured during an outage too.
- `acall_with_retry` (asyncio, the orchestrator): runs the call in a daemon thread of its own and waits
  with `asyncio.sleep`, so cancelling the task (SIGTERM) stops it at once, and the process exits at once
  too: a call blocked on a Redis that does not answer (frozen, cut off by the network) is left to its
  thread. In `asyncio.to_thread`'s executor, `asyncio.run` waited for it on the way out, up to the
  client's `socket_timeout` (30 s for the orchestrator's), beyond a pod's or `gyre rl`'s stop grace.
  A call its caller lets run on through a stop (the orchestrator's push) raises `Stopped` once
  `should_stop()` is true while Redis is unavailable: a Redis stopped with the release (`helm uninstall` stops
  every pod at once) does not come back within the stop's grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis

log = logging.getLogger(__name__)
T = TypeVar("T")
RETRYABLE = (redis.ConnectionError, redis.TimeoutError, redis.OutOfMemoryError)


class Stopped(Exception):  # noqa: N818 - control flow, not an error
    """A stop was requested while waiting for Redis to come back."""


class RedisUnavailable(RuntimeError):
    """Redis did not answer within the retry deadline."""


class RedisAuthenticationFailed(RuntimeError):
    """Redis refused the client's password (or asked for one it was not given): a configuration error."""


def _refused(what: str, error: redis.AuthenticationError) -> RedisAuthenticationFailed:
    return RedisAuthenticationFailed(
        f"redis refused the connection during {what}: {error} — check redis.password (or redis.password_file)"
    )


def _state(error: Exception) -> str:
    return "full (maxmemory)" if isinstance(error, redis.OutOfMemoryError) else "unavailable"


def _give_up(what: str, deadline_s: float, error: Exception) -> RedisUnavailable:
    return RedisUnavailable(f"redis {_state(error)} for {deadline_s:.0f}s during {what}: {error}")


def call_with_retry(
    op: Callable[[], T],
    *,
    what: str = "a redis call",
    should_stop: Callable[[], bool] | None = None,
    deadline_s: float | None = None,
    initial_s: float = 0.5,
    max_s: float = 30.0,
) -> T:
    """`op()` until Redis answers; `Stopped` when `should_stop()`; `RedisUnavailable` after `deadline_s`."""
    start, delay = time.monotonic(), initial_s
    while True:
        try:
            return op()
        except redis.AuthenticationError as e:
            raise _refused(what, e) from e
        except RETRYABLE as e:
            elapsed = time.monotonic() - start
            if deadline_s is not None and elapsed >= deadline_s:
                raise _give_up(what, deadline_s, e) from e
            log.warning("redis %s during %s (%s); retrying in %.1fs", _state(e), what, e, delay)
            wake = time.monotonic() + delay
            if deadline_s is not None:
                wake = min(wake, start + deadline_s)
            while time.monotonic() < wake:
                if should_stop is not None and should_stop():
                    raise Stopped from None
                time.sleep(min(0.1, max(0.0, wake - time.monotonic())))
            delay = min(delay * 2, max_s)


def _in_daemon_thread(op: Callable[[], T]) -> asyncio.Future[T]:
    """`op()` in a daemon thread of its own; its outcome as a future of the running loop. Nothing waits for the
    thread at exit (an executor's worker is joined by `asyncio.run` and by the interpreter)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: BaseException | None, value: T | None) -> None:
        if future.done():  # the caller was cancelled meanwhile
            return
        if outcome is None:
            future.set_result(value)
        else:
            future.set_exception(outcome)

    def run() -> None:
        try:
            value, outcome = op(), None
        except BaseException as e:  # handed to the caller, whatever it is
            value, outcome = None, e
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for this call any more
            loop.call_soon_threadsafe(settle, outcome, value)

    threading.Thread(target=run, name="redis-call", daemon=True).start()
    return future


async def acall_with_retry(
    op: Callable[[], T],
    *,
    what: str = "a redis call",
    should_stop: Callable[[], bool] | None = None,
    deadline_s: float | None = None,
    initial_s: float = 0.5,
    max_s: float = 30.0,
) -> T:
    """`op()` in a daemon thread until Redis answers; cancellable; `Stopped` when `should_stop()` while Redis is
    unavailable (checked at each failure and while waiting to retry); `RedisUnavailable` after `deadline_s`."""
    start, delay = time.monotonic(), initial_s
    while True:
        try:
            return await _in_daemon_thread(op)
        except redis.AuthenticationError as e:
            raise _refused(what, e) from e
        except RETRYABLE as e:
            elapsed = time.monotonic() - start
            if deadline_s is not None and elapsed >= deadline_s:
                raise _give_up(what, deadline_s, e) from e
            log.warning("redis %s during %s (%s); retrying in %.1fs", _state(e), what, e, delay)
            wake = time.monotonic() + (delay if deadline_s is None else min(delay, deadline_s - elapsed))
            while True:
                if should_stop is not None and should_stop():
                    raise Stopped from e
                left = wake - time.monotonic()
                if left <= 0:
                    break
                await asyncio.sleep(min(0.1, left))
            delay = min(delay * 2, max_s)
