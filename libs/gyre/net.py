"""Small networking helpers shared by services, the launcher and tests."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now.

    The port is released before returning, so another process could grab it before the caller
    binds; callers that can bind port 0 themselves should prefer that. It is fine for starting a
    child server (e.g. redis-server, which cannot report a port it picked) and retrying on failure.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class PortInUse(OSError):
    """A service could not bind a configured port; the message names the option to change."""


def bind_or_explain(start: Callable[[], T], service: str, option: str, port: int | None) -> T:
    """`start()` (which binds `port`), turning a bind failure into `PortInUse` naming `option`.

    gRPC reports a busy port as RuntimeError("Failed to bind ...") or a 0 port, the HTTP servers as
    OSError(EADDRINUSE): either way the user learns which option to change, not a traceback.
    """
    try:
        return start()
    except (OSError, RuntimeError) as e:
        raise PortInUse(
            f"{service}: cannot listen on port {port} ({e}); another process is using it: "
            f"set --{option} to a free port (0 = pick one)"
        ) from None
