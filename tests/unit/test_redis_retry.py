"""Retrying through a Redis outage, but not through a refused password (a real password-protected Redis); a
cancelled call to a Redis that does not answer keeps no process from exiting."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import redis
from gyre.redis_retry import acall_with_retry, call_with_retry
from gyre.redis_server import EmbeddedRedis


@pytest.fixture(scope="module")
def locked_redis():
    with EmbeddedRedis(password="the-right-one") as server:
        yield server


@pytest.mark.parametrize("password", ["a-wrong-one", None])
def test_a_refused_password_fails_at_once_naming_the_key(locked_redis, password):
    """redis-py reports a wrong or missing password as a ConnectionError subclass; retrying it until the
    deadline (as for an outage) would only hide a configuration error behind minutes of warnings."""
    client = redis.Redis(host=locked_redis.host, port=locked_redis.port, password=password)
    started = time.monotonic()
    with pytest.raises(Exception, match=r"redis\.password"):
        call_with_retry(client.ping, what="the test's ping", deadline_s=120)
    with pytest.raises(Exception, match="the test's ping"):
        asyncio.run(acall_with_retry(client.ping, what="the test's ping", deadline_s=120))
    # redis-py itself retries a few times (~4 s a call); our helper adds nothing, far inside its 120 s deadline
    assert time.monotonic() - started < 40
    client.close()


def test_the_right_password_goes_through(locked_redis):
    client = locked_redis.client()
    assert call_with_retry(client.ping) is True
    client.close()


def test_a_process_cancelling_a_call_to_a_frozen_redis_exits_at_once():
    """SIGTERM cancels the orchestrator's Redis call at once, but the call ran in asyncio's executor, which
    `asyncio.run` joins on the way out: a Redis that does not answer (frozen here; a network partition) held the
    exit for the client's socket_timeout (30 s for the orchestrator), past a pod's grace period."""
    script = (
        "import asyncio, sys, redis\n"
        "from gyre.redis_retry import acall_with_retry\n"
        "client = redis.Redis.from_url(sys.argv[1], socket_timeout=30)\n"
        "async def main():\n"
        "    call = asyncio.create_task(acall_with_retry(lambda: client.get('x'), what='a read'))\n"
        "    await asyncio.sleep(1.0)\n"
        "    call.cancel()\n"
        "    await asyncio.gather(call, return_exceptions=True)\n"
        "asyncio.run(main())\n"
    )
    with EmbeddedRedis() as server:
        server.client().ping()
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            done = subprocess.run([sys.executable, "-c", script, server.url], capture_output=True, text=True,
                                  timeout=60)  # fmt: skip
            took = time.monotonic() - started
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert took < 15, f"the process waited {took:.0f}s for the frozen Redis call"
