"""The real OpenAI HTTP app of a backend, served in-process on a free port (as `gyre inference` wires it)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from gyre_inference.backend import Backend


@contextlib.asynccontextmanager
async def serve_app(backend, model_dir: Path, run_id: str, prepare=None, **state) -> AsyncIterator[str]:
    """Load `backend` (model id "tiny"), run `await prepare(backend)` if given, serve the app (`state`: more
    `AppState` fields); yields the `/v1` base URL. On exit the server stops and the backend shuts down."""
    import uvicorn
    from gyre_inference.api import AppState, create_app
    from gyre_inference.metrics import InferenceMetrics
    from gyre_inference.service import _bind, _HTTPServer, _load
    from gyre_inference.text import ModelText

    state = AppState("tiny", str(model_dir), backend, InferenceMetrics(run_id, backend), **state)
    await _load(state, backend, str(model_dir), ModelText)
    if prepare is not None:
        await prepare(backend)
    sock = _bind("127.0.0.1", 0)
    http = _HTTPServer(uvicorn.Config(create_app(state), log_config=None, lifespan="off"))
    task = asyncio.create_task(http.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        http.should_exit = True
        await task
        await backend.shutdown()


class StandInBackend(Backend):
    """A backend without a model for HTTP-layer tests: ready once started, version 0, context 1024, no weight
    updates; a subclass says what `generate` yields."""

    name = "stand-in"
    _ready = False

    ready = property(lambda self: self._ready)
    version = property(lambda self: 0)
    max_model_len = property(lambda self: 1024)

    def load_stats(self):
        return 0, 0

    async def start(self):
        self._ready = True

    async def shutdown(self):
        self._ready = False

    async def update_weights(self, weights):
        raise NotImplementedError

    async def reload_base(self):
        raise NotImplementedError
