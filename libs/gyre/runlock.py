"""Locks on a run's output folder: one `gyre rl` per folder, one trainer and one orchestrator per run.

`{output_dir}/locks/{role}.lock` is held with `flock` for the life of the process and names its
holder (`pid`, host, command) inside. A second process asking for a held role fails at once with
`LockHeld`, whose message names the holder's pid. The kernel drops a `flock` when its holder dies,
however it dies (SIGKILL included), so a lock left by a dead process is simply taken over; the file's
old contents are only used to say whose lock that was.

Roles: `rl` (the launcher), `trainer` (rank 0 only), `orchestrator`, `sft` (`gyre sft`, rank 0, which also locks
its save_dir as role `save-{name}` of the folder above it). Inference replicas take no lock:
a run has many. `flock` is advisory and per host: on a shared network volume (Kubernetes) it guards
against two launches on one node only; the chart runs one trainer and one orchestrator per release.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

# roles said as the command that holds them ("another rl is using this output folder" read as a typo)
COMMANDS = {"rl": "gyre rl", "sft": "gyre sft"}


class LockHeld(RuntimeError):
    """The role's lock is held by another live process (its pid is in the message and `holder`)."""

    def __init__(self, message: str, holder: dict):
        super().__init__(message)
        self.holder = holder


def lock_path(output_dir: Path | str, role: str) -> Path:
    return Path(output_dir) / "locks" / f"{role}.lock"


class RunLock:
    """`flock` on `{output_dir}/locks/{role}.lock`; `acquire()` / `release()` or a context manager."""

    def __init__(self, output_dir: Path | str, role: str):
        self.path = lock_path(output_dir, role)
        self.role = role
        self._fd: int | None = None
        self.previous: dict = {}  # what the file said before we took it (a stale holder, if any)

    def acquire(self, wait_s: float = 0.0, info: dict | None = None) -> RunLock:
        """Take the lock; wait up to `wait_s` for a live holder to exit, else raise `LockHeld`. `info`: more about the
        holder for others to read (`running_holder`), e.g. the orchestrator's requested rewind."""
        if self._fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = read_holder(self.path)
                    os.close(fd)
                    raise LockHeld(
                        f"{self.path} is held by pid {holder.get('pid', '?')} on {holder.get('host', '?')} "
                        f"({holder.get('command', 'unknown command')}): another {COMMANDS.get(self.role, self.role)} "
                        "is using this output folder; stop it or choose another --output-dir",
                        holder,
                    ) from None
                time.sleep(0.2)
        self.previous = read_holder(self.path)
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": " ".join(sys.argv)[:300],
            "since": time.time(),
            **(info or {}),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self._fd = fd
        return self

    @property
    def took_over(self) -> int | None:
        """The pid of a dead holder whose lock this one replaced (None if the lock was free and clean)."""
        pid = self.previous.get("pid")
        return pid if isinstance(pid, int) and pid != os.getpid() else None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # an empty file: released cleanly (no stale holder to report)
            os.close(fd)  # closing the descriptor drops the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def read_holder(path: Path) -> dict:
    try:
        doc = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def running_holder(output_dir: Path | str, role: str) -> dict | None:
    """What the live holder of `role`'s lock on `output_dir` wrote, when it is a process on this host (read without
    taking the lock: a process starting right then must not find it held); None when nobody holds it, its holder
    died, or it runs on another host (its liveness cannot be told from here)."""
    holder = read_holder(lock_path(output_dir, role))
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid == os.getpid() or holder.get("host") != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None  # a crashed holder's stale file
    except PermissionError:
        pass  # alive, another user's
    return holder
