"""A small ASGI app served by a real uvicorn server on a thread of the test process (`serving`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn


@contextlib.contextmanager
def serving(app, port: int, **config) -> Iterator[uvicorn.Server]:
    """`app` on 127.0.0.1:`port` (uvicorn `config` keys besides), started when entered, stopped on exit."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(10)
