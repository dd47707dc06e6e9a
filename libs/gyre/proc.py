"""Child processes: one home for PR_SET_PDEATHSIG and for a service child with a log file.

`Child` is what `gyre rl` runs its services as, what `gyre.inference_process` builds on, and what the
benches and tests start servers with: its own process group (Ctrl-C is the parent's to handle, and a
stop reaches the child's own children), stdout+stderr into a log file, optional echo to the console,
and every complete output line handed to `on_line` (how a ready line is noticed).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO


def set_pdeathsig(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent thread dies (Linux; else a no-op).

    Meant as a `preexec_fn` (runs in the child between fork and exec), so a SIGKILLed parent leaves
    no orphans. The signal follows the death of the *thread* that forked: start children from a
    thread that outlives them (the main thread, in practice).
    """
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG


def alive(pid: int) -> bool:
    """Whether process `pid` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pdeathsig_if_main_thread() -> Callable[[], None] | None:
    """`set_pdeathsig` as a `preexec_fn` when called from the main thread, else None: a child started from a
    short-lived thread would otherwise be killed when that thread ends."""
    return set_pdeathsig if threading.current_thread() is threading.main_thread() else None


# A warning, an error or a traceback, in the services' text or JSON log format (gyre.logging).
_TROUBLE = re.compile(r' (ERROR|WARNING|CRITICAL) |"level": "(ERROR|WARNING|CRITICAL)"|Traceback')


def _trouble(line: str) -> bool:
    return _TROUBLE.search(line) is not None


def _print(text: str) -> None:
    print(text, flush=True)


@dataclass
class Child:
    """One child process; its stdout+stderr go to ``log_path`` (appended) and, with ``echo``, to ``console``.

    Without ``echo`` only lines that look like trouble (ERROR, WARNING, a traceback) reach the console.
    ``on_line`` gets every complete line (decoded, without its end), from the thread that pumps the output.
    """

    name: str
    argv: list[str]
    log_path: Path
    on_line: Callable[[str], None] | None = None
    console: Callable[[str], None] = _print
    proc: subprocess.Popen | None = None
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self, echo: bool = False, env: dict[str, str] | None = None, quiet: bool = False) -> Child:
        """Start it. `quiet`: nothing reaches the console, not even warnings (tests, benches)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path, "ab", buffering=0)  # noqa: SIM115 - closed by the pump thread
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # own process group: Ctrl-C is handled by the parent, stop() reaches the group
            preexec_fn=pdeathsig_if_main_thread(),
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        t = threading.Thread(target=self._pump, args=(self.proc.stdout, logf, echo, quiet), daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def _pump(self, stream: IO[bytes], logf: IO[bytes], echo: bool, quiet: bool) -> None:
        # Progress bars end their updates with \r, not \n: split on both so a child's tqdm bar shows
        # up on the console (at most every few seconds), while the log file keeps the raw bytes.
        pending, last_bar, callback_failed = b"", 0.0, False
        with logf:
            while chunk := stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536):
                logf.write(chunk)
                pending += chunk
                *segments, pending = re.split(rb"(\r|\n)", pending)
                for text, sep in zip(segments[::2], segments[1::2], strict=True):
                    line = text.decode(errors="replace").rstrip()
                    if not line:
                        continue
                    if sep == b"\r":
                        if echo and not quiet and time.monotonic() - last_bar > 5:
                            last_bar = time.monotonic()
                            quiet = not self._echo(f"[{self.name}] {line}", logf)
                        continue
                    if self.on_line is not None:
                        try:
                            self.on_line(line)
                        except Exception as error:  # whatever it is, the pipe must be read on (see `_echo`)
                            if not callback_failed:
                                callback_failed = True
                                logf.write(f"[gyre] {self.name}: on_line failed: {error!r}\n".encode())
                    if not quiet and (echo or _trouble(line)):
                        quiet = not self._echo(f"[{self.name}] {line}", logf)

    def _echo(self, text: str, logf: IO[bytes]) -> bool:
        """`text` to the console; False when the console failed (a closed pipe: `gyre rl | head`, a `| tee` that a
        Ctrl-C ended first), which then gets nothing more. An error here ended the pump: nothing read the pipe,
        and once it was full the child blocked in a write for ever (a service mid-stop, its checkpoint lost)."""
        try:
            self.console(text)
            return True
        except Exception as error:
            logf.write(f"[gyre] {self.name}: no more console output ({error!r}); this log has it all\n".encode())
            return False

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit (TimeoutExpired after `timeout`) and for the log to be complete; the status."""
        code = self.proc.wait(timeout)
        for t in self._threads:
            t.join(timeout=5)
        return code

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM to the process group, SIGKILL after `timeout` s; the exit status (killed: negative)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, sig)
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        for t in self._threads:
            t.join(timeout=2)
        return self.proc.returncode

    def kill(self) -> int | None:
        """SIGKILL to the process group at once (a crash, as tests simulate it); the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.wait()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, n: int = 25) -> str:
        lines = self.log().splitlines()
        return "\n".join(lines[-n:]) if lines else "(no log)"
