"""`gyre inference` as a child process, and its ready line: one home for both sides of that contract.

A replica prints one line once its model is loaded and both servers answer (`ready_line`, printed by
`gyre_inference.service`):

    ready: http://HOST:PORT control: HOST:PORT version: N

Everything that starts a replica and waits for it (`gyre rl`, the benches, the tests) uses
`InferenceProcess`: a `gyre.proc.Child` that watches its output for that line. Ports given as 0 are
picked by the replica and read back from the line.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gyre.proc import Child

READY = re.compile(r"^ready: (http://\S+) control: (\S+) version: (\d+)$")


@dataclass(frozen=True)
class Ready:
    """What a replica's ready line says: where it serves HTTP and gRPC control, and its weights version."""

    url: str  # http://host:port
    control: str  # host:port
    version: int

    @property
    def base_url(self) -> str:
        """The OpenAI base URL."""
        return self.url + "/v1"


def ready_line(url: str, control: str, version: int) -> str:
    return f"ready: {url} control: {control} version: {version}"


def parse_ready(line: str) -> Ready | None:
    """The ready line's contents, from the plain line or (`log.format = "json"`) a JSON record's message."""
    line = line.strip()
    if line.startswith("{"):
        try:
            line = str(json.loads(line).get("message", ""))
        except (ValueError, AttributeError):
            return None
    match = READY.match(line)
    return None if match is None else Ready(match.group(1), match.group(2), int(match.group(3)))


class NotReady(RuntimeError):
    """A replica exited, or did not print its ready line in time; the message ends with its log's tail."""


def inference_argv(*args: str) -> list[str]:
    """The command line of `gyre inference ARGS` with this interpreter."""
    return [sys.executable, "-m", "gyre.cli", "inference", *args]


class InferenceProcess(Child):
    """`gyre inference ARGS` in its own process group, logging to `log_path`; `wait_ready` waits for its
    ready line. `start_inference` is the usual way in: start, wait, and on failure stop it and raise."""

    def __init__(self, *args: str, log_path: Path, name: str = "inference", argv: list[str] | None = None,
                 console: Callable[[str], None] | None = None):  # fmt: skip
        """`argv`: run this command instead of `gyre inference ARGS` (a stand-in that prints the same line)."""
        super().__init__(name, argv or inference_argv(*args), Path(log_path), on_line=self._watch)
        if console is not None:
            self.console = console
        self.ready: Ready | None = None
        self._ready = threading.Event()

    def _watch(self, line: str) -> None:
        if self.ready is None and (found := parse_ready(line)) is not None:
            self.ready = found
            self._ready.set()

    def wait_ready(self, timeout: float) -> Ready:
        """The ready line's contents once it was printed; NotReady when the process exits or `timeout` passes
        first (the process is left as it is)."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if self.poll() is not None:
                self.wait()  # the log is complete
                raise NotReady(f"{self.name} exited with status {self.poll()} before becoming ready; "
                               f"last lines of {self.log_path}:\n{self.tail()}")  # fmt: skip
            if time.monotonic() > deadline:
                raise NotReady(f"{self.name} not ready after {timeout:.0f}s; last lines of {self.log_path}:\n"
                               f"{self.tail()}")  # fmt: skip
        return self.ready

    # what the ready line said, for callers that hold the process
    @property
    def url(self) -> str:
        return self._said().url

    @property
    def base_url(self) -> str:
        return self._said().base_url

    @property
    def control(self) -> str:
        return self._said().control

    def _said(self) -> Ready:
        if self.ready is None:
            raise NotReady(f"{self.name} has not printed its ready line")
        return self.ready


def start_inference(*args: str, log_path: Path, timeout: float = 300.0, env: dict[str, str] | None = None,
                    name: str = "inference", argv: list[str] | None = None, echo: bool = False,
                    quiet: bool = True) -> InferenceProcess:  # fmt: skip
    """Start `gyre inference ARGS` (or `argv`) and wait until it is ready; on failure it is killed and NotReady
    raised."""
    process = InferenceProcess(*args, log_path=log_path, name=name, argv=argv)
    process.start(echo=echo, env=env, quiet=quiet)
    try:
        process.wait_ready(timeout)
    except BaseException:
        process.kill()
        raise
    return process
