"""Append-only JSONL event logs under `{output_dir}/events/` (read by tests, `gyre report`, the launcher).

Each record is one JSON object on one line, written with a single `write` on an O_APPEND descriptor,
so concurrent writers never interleave inside a line and a crash can at worst truncate the last line
(which `read_events` tolerates; a writer that opens the file while another's line is half written ends that line
after it, a blank line that readers skip). No fsync: these are observability artifacts, not state.

Run segments: every record carries `segment`, the id of the launch that wrote it (`gyre rl` gives
all its services one id through `GYRE_RUN_SEGMENT`; a service started alone makes its own). A
resumed run appends to the same files, so a step can appear twice (e.g. a batch regenerated after
the stream lost it); `latest_per_step` keeps the newest segment's record of each step, which is
what makes a resumed run's curves continue instead of restarting.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from gyre.fsio import free_space

log = logging.getLogger(__name__)

# File names: the contract in docs/architecture.md, "Event logs".
TRAINER_STEPS = "trainer_steps.jsonl"
ORCHESTRATOR_STEPS = "orchestrator_steps.jsonl"
WEIGHT_RELAY = "weight_relay.jsonl"
EVAL = "eval.jsonl"
EVENT_FILES = (TRAINER_STEPS, ORCHESTRATOR_STEPS, WEIGHT_RELAY, EVAL)
SEGMENT_ENV = "GYRE_RUN_SEGMENT"


def new_segment_id() -> str:
    """A fresh run-segment id: sortable by start time, unique per launch."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{os.getpid()}"


_SEGMENT = os.environ.get(SEGMENT_ENV) or new_segment_id()


def current_segment() -> str:
    """The run-segment id this process writes (GYRE_RUN_SEGMENT, or one made at import)."""
    return _SEGMENT


def events_dir(output_dir: Path | str) -> Path:
    return Path(output_dir) / "events"


def _json_safe(value: Any) -> Any:
    # NaN/inf are not JSON; null keeps every line parseable by any reader
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy / torch scalars and arrays
        return _json_safe(value.tolist())
    return value


class EventLog:
    """Appends records to one JSONL file; `time` (unix seconds) and `segment` are added when missing."""

    def __init__(self, path: Path | str, segment: str | None = None):
        self.path = Path(path)
        self.segment = segment or current_segment()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        # a previous writer died mid-line: end that line so our first record starts on its own line
        if _ends_without_newline(self.path):
            os.write(self._fd, b"\n")

    def append(self, record: dict[str, Any]) -> dict[str, Any]:
        """Write one line; returns the record as written."""
        record = _json_safe(
            {**record, "time": record.get("time", time.time()), "segment": record.get("segment", self.segment)}
        )
        line = (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode()
        with self._lock:
            if self._fd < 0:
                raise ValueError(f"EventLog {self.path} is closed")
            try:
                written = os.write(self._fd, line)
            except OSError as e:  # ENOSPC and friends name no file on their own
                reason = f"cannot append to the event log: {e.strerror} ({free_space(self.path.parent)})"
                raise OSError(e.errno, reason, str(self.path)) from e
        if written != len(line):  # regular files don't short-write short of ENOSPC; say so if they do
            log.error("short write to %s: %d of %d bytes", self.path, written, len(line))
        return record

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown may have torn down os
            self.close()


def _ends_without_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def read_events(path: Path | str) -> list[dict[str, Any]]:
    """All records of a JSONL file ([] if it does not exist), in file order.

    Lines that are not a JSON object are skipped: a truncated last line (writer killed mid-write,
    or a line being written right now) silently, an earlier one (left by a writer that crashed
    before a restart) with a warning. Readers of artifacts must not die on a crash's leftovers.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif i < len(lines) - 1:  # the last piece has no newline after it: unfinished, not corrupt
            log.warning("%s: skipping line %d, not a JSON object: %r", path, i + 1, line[:80])
    return records


def latest_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per `step`, the last one written (a resumed run's, if it redid the step), by step.

    Records without an integer `step` are dropped. File order is write order, so "last" is newest.
    """
    by_step: dict[int, dict[str, Any]] = {}
    for record in records:
        step = record.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            by_step[step] = record
    return [by_step[s] for s in sorted(by_step)]
