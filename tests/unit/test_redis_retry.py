"""Retrying through a Redis outage, but not through a refused password (a real password-protected Redis)."""

from __future__ import annotations

import asyncio
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
