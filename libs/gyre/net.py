"""Small networking helpers shared by services, the launcher and tests."""

from __future__ import annotations

import socket
import threading
from collections import deque
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


# The ports free_port handed out lately: the launcher picks a dozen (HTTP, gRPC, metrics of each service) before
# any child binds one, and the kernel's pick for port 0 repeats (1 in 200 calls here): a trainer got its metrics
# port as its gRPC port once and could not start.
_HANDED_OUT: deque[int] = deque(maxlen=1024)
_HANDED_OUT_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now, and not one this process handed out lately.

    The port is released before returning, so another process could grab it before the caller
    binds; callers that can bind port 0 themselves should prefer that. It is fine for starting a
    child server (e.g. redis-server, which cannot report a port it picked) and retrying on failure.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with _HANDED_OUT_LOCK:
        for _ in range(64):
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
            if port not in _HANDED_OUT:
                _HANDED_OUT.append(port)
                return port
    raise OSError(f"no free port on {host} that was not handed out already (64 tries)")


class PortInUse(OSError):
    """A service could not bind a configured address; the message names the option to change."""


def _host_bindable(host: str) -> OSError | None:
    """None when `host` is an address of this machine (a free port on it binds), else why not."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
    except OSError as e:  # EADDRNOTAVAIL: another machine's address; gaierror: a name that does not resolve
        return e
    return None


def bind_failure(service: str, host: str, host_option: str, port: int | None, option: str, error: object) -> PortInUse:
    """`PortInUse` for a failed bind of `host`:`port`, naming the option to change.

    A busy port and a `host` that is no address of this machine (a pod's IP copied into the config, a typo)
    fail alike: gRPC says only "Failed to bind", and the message blamed the port. The host is tried on its own
    (a free port on it) to tell them apart.
    """
    if (bad_host := _host_bindable(host)) is not None:
        return PortInUse(
            f"{service}: cannot listen on {host!r} ({bad_host.strerror or bad_host}): it is not an address of this "
            f"machine: set --{host_option} to one of its addresses (0.0.0.0: all of them, 127.0.0.1: this machine only)"
        )
    return PortInUse(
        f"{service}: cannot listen on port {port} ({error}); another process is using it: "
        f"set --{option} to a free port (0 = pick one)"
    )


def bind_or_explain(start: Callable[[], T], service: str, option: str, port: int | None, host: str,
                    host_option: str = "server.host") -> T:  # fmt: skip
    """`start()` (which binds `host`:`port`), turning a bind failure into `PortInUse` naming the option to change.

    gRPC reports a busy port as RuntimeError("Failed to bind ...") or a 0 port, the HTTP servers as
    OSError(EADDRINUSE): either way the user learns which option to change, not a traceback.
    """
    try:
        return start()
    except (OSError, RuntimeError) as e:
        raise bind_failure(service, host, host_option, port, option, e) from None
