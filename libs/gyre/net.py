"""Small networking helpers shared by services, the launcher and tests."""

from __future__ import annotations

import socket


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
