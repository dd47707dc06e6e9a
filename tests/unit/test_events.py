"""Event logs: one JSON object per line, concurrent appenders, truncated lines after a crash."""

from __future__ import annotations

import errno
import math
import multiprocessing as mp
import os
import threading

import numpy as np
import pytest
from gyre.events import (
    EVAL,
    EVENT_FILES,
    ORCHESTRATOR_STEPS,
    TRAINER_STEPS,
    WEIGHT_RELAY,
    EventLog,
    current_segment,
    events_dir,
    read_events,
)


def test_contract_file_names(tmp_path):
    assert (TRAINER_STEPS, ORCHESTRATOR_STEPS, WEIGHT_RELAY, EVAL) == (
        "trainer_steps.jsonl",
        "orchestrator_steps.jsonl",
        "weight_relay.jsonl",
        "eval.jsonl",
    )
    assert set(EVENT_FILES) == {TRAINER_STEPS, ORCHESTRATOR_STEPS, WEIGHT_RELAY, EVAL}
    assert events_dir(tmp_path) == tmp_path / "events"


def test_append_and_read_back(tmp_path):
    path = events_dir(tmp_path) / TRAINER_STEPS
    with EventLog(path) as log:
        written = log.append(
            {"step": 1, "loss": np.float32(0.5), "grad_norm": math.inf, "num_tokens": np.int64(7), "hist": np.arange(3)}
        )
        log.append({"step": 2, "loss": 0.25, "time": 123.0})
    records = read_events(path)
    assert records == [written, {"step": 2, "loss": 0.25, "time": 123.0, "segment": log.segment}]
    assert log.segment == current_segment()  # every record names the launch (run segment) that wrote it
    assert records[0]["loss"] == 0.5 and records[0]["num_tokens"] == 7 and records[0]["hist"] == [0, 1, 2]
    assert records[0]["grad_norm"] is None  # non-finite floats become null so every line stays JSON
    assert isinstance(records[0]["time"], float)
    assert path.read_text().count("\n") == 2
    assert read_events(tmp_path / "missing.jsonl") == []


def test_truncated_last_line_is_ignored_and_next_writer_starts_clean(tmp_path):
    path = tmp_path / "e.jsonl"
    EventLog(path).append({"step": 1})
    with open(path, "ab") as f:
        f.write(b'{"step": 2, "lo')  # a writer killed mid-line
    assert [r["step"] for r in read_events(path)] == [1]
    EventLog(path).append({"step": 3})  # a restarted writer
    assert [r["step"] for r in read_events(path)] == [1, 3]


def _append_many(path, worker, n):
    log = EventLog(path)
    for i in range(n):
        log.append({"worker": worker, "i": i, "pad": "x" * 2000})


def test_concurrent_writers_never_interleave_lines(tmp_path):
    path = tmp_path / "e.jsonl"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(path, w, 100)) for w in range(2)]
    for p in procs:
        p.start()
    log = EventLog(path)
    threads = [threading.Thread(target=lambda: [log.append({"worker": "t", "i": i}) for i in range(100)])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    records = read_events(path)
    # a writer opened while another's line is half on disk ends that line (EventLog.__init__), after it: a blank
    # line, which readers skip; what must never happen is two records in one line or one record in two
    assert len(records) == 300 == len([line for line in path.read_bytes().splitlines() if line])
    for worker in (0, 1, "t"):
        assert [r["i"] for r in records if r["worker"] == worker] == list(range(100))


def test_a_full_volume_is_an_error_naming_the_log(tmp_path):
    # /dev/full answers every write with ENOSPC, as a full volume does; the bare OSError named no file
    log = EventLog(tmp_path / "steps.jsonl")
    os.close(log._fd)
    log._fd = os.open("/dev/full", os.O_WRONLY)
    with pytest.raises(OSError, match="steps.jsonl") as caught:
        log.append({"step": 1})
    assert caught.value.errno == errno.ENOSPC
    log.close()
