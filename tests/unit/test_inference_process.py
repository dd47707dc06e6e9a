"""`gyre.inference_process`: the ready line's two sides, and waiting for a child that prints it (or dies)."""

from __future__ import annotations

import os
import sys

import pytest
from gyre.inference_process import NotReady, Ready, parse_ready, ready_line, start_inference


def test_the_ready_line_round_trips():
    line = ready_line("http://127.0.0.1:8000", "127.0.0.1:50051", 7)
    assert parse_ready(line + "\n") == Ready("http://127.0.0.1:8000", "127.0.0.1:50051", 7)
    assert parse_ready(line).base_url == "http://127.0.0.1:8000/v1"
    assert parse_ready("INFO ready: soon") is None


def stand_in(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_child_that_prints_the_line_is_ready_with_what_it_said(tmp_path):
    code = f"import time; print('loading'); print({ready_line('http://h:1', 'h:2', 3)!r}); time.sleep(60)"
    process = start_inference(log_path=tmp_path / "ok.log", argv=stand_in(code), timeout=60)
    try:
        assert (process.url, process.control, process.base_url) == ("http://h:1", "h:2", "http://h:1/v1")
        assert process.ready.version == 3
    finally:
        assert process.stop(timeout=10) is not None
    assert process.poll() is not None and "loading" in process.log()


def test_a_child_that_dies_first_is_named_with_its_status_and_log(tmp_path):
    code = "import sys; print('cannot load model /nope', file=sys.stderr); sys.exit(3)"
    with pytest.raises(NotReady, match=r"(?s)exited with status 3 before becoming ready.*cannot load model /nope"):
        start_inference(log_path=tmp_path / "dead.log", argv=stand_in(code), timeout=60)


def test_a_child_that_never_gets_ready_times_out_and_is_killed(tmp_path):
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    with pytest.raises(NotReady, match="not ready after 1s"):
        start_inference(log_path=tmp_path / "slow.log", argv=stand_in(code), timeout=1)
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)
