"""setup_logging: one-line text or JSON format to stderr and a file, idempotent, strict about levels and formats."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import pytest
from gyre.logging import setup_logging

LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (\w+) (\S+) ([\w.]+): (.*)$")


@pytest.fixture
def restore_root_logger():
    root = logging.getLogger()
    handlers, level, excepthook = list(root.handlers), root.level, sys.excepthook
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)
    sys.excepthook = excepthook  # JSON mode logs uncaught exceptions and warnings, and routes transformers' records
    logging.captureWarnings(False)
    from transformers.utils import logging as hf_logging

    hf_logging.enable_default_handler()
    hf_logging.disable_propagation()


def test_format_file_and_level(tmp_path, capsys, restore_root_logger):
    log_file = tmp_path / "logs" / "trainer.log"
    setup_logging("info", log_file, service="trainer")
    setup_logging("info", log_file, service="trainer")  # a second call must not duplicate lines
    logging.getLogger("gyre_trainer.loop").info("trained step %d", 3)
    logging.getLogger("gyre_trainer.loop").debug("hidden")
    file_lines = log_file.read_text().splitlines()
    assert len(file_lines) == 1
    assert LINE.match(file_lines[0]).groups() == ("INFO", "trainer", "gyre_trainer.loop", "trained step 3")
    stderr_lines = [line for line in capsys.readouterr().err.splitlines() if "trained step" in line]
    assert stderr_lines == file_lines


def test_unknown_level_is_rejected(restore_root_logger):
    with pytest.raises(ValueError, match="unknown log level"):
        setup_logging("chatty", None, service="x")


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]  # every line, or json.loads fails the test


def test_json_format_one_object_per_line_traceback_inside(tmp_path, capsys, restore_root_logger):
    log_file = tmp_path / "trainer.log"
    setup_logging("info", log_file, service="trainer-rank1", fmt="json", run_id="exp1")
    loop = logging.getLogger("gyre_trainer.loop")
    loop.info("trained step %d", 3, extra={"step": 3, "path": tmp_path})
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        loop.exception("step %d failed", 4, extra={"step": 4})
    loop.warning("here", stack_info=True)
    records = _json_lines(log_file.read_text())
    assert len(records) == 3
    first = records[0]
    assert set(first) == {"time", "level", "severity", "service", "run_id", "logger", "message", "step", "path"}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"])
    assert (first["level"], first["severity"], first["service"], first["run_id"]) == ("INFO", "INFO", "trainer-rank1",
                                                                                       "exp1")  # fmt: skip
    assert (first["logger"], first["message"], first["step"]) == ("gyre_trainer.loop", "trained step 3", 3)
    assert first["path"] == str(tmp_path)  # a value JSON cannot hold is its string
    failed = records[1]
    assert (failed["level"], failed["message"], failed["step"]) == ("ERROR", "step 4 failed", 4)
    assert failed["exception"].startswith("Traceback (most recent call last):")
    assert failed["exception"].endswith("RuntimeError: boom\nsecond line")
    assert "test_json_format_one_object_per_line" in records[2]["stack"]
    assert _json_lines(capsys.readouterr().err) == records  # stderr (kubectl logs) holds the same objects


def test_json_uncaught_exception_is_one_record(tmp_path):
    # a crash outside any handler (the services' mains let an unexpected error propagate) is one JSON record too
    code = (
        "from gyre.logging import setup_logging\n"
        "setup_logging('info', None, 'orchestrator', 'json', 'exp1')\n"
        "import warnings; warnings.warn('old option')\n"
        "raise ValueError('bad\\nthing')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    records = _json_lines(proc.stderr)
    assert [(r["level"], r["logger"]) for r in records] == [("WARNING", "py.warnings"), ("CRITICAL", "gyre")]
    assert "old option" in records[0]["message"]
    assert records[1]["exception"].endswith("ValueError: bad\nthing")


def test_text_format_is_back_after_json(tmp_path, capsys, restore_root_logger):
    setup_logging("info", None, service="trainer", fmt="json")
    setup_logging("info", None, service="trainer", fmt="text")
    logging.getLogger("x").info("plain")
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "plain" in line]
    assert LINE.match(line).groups() == ("INFO", "trainer", "x", "plain")
    assert sys.excepthook is sys.__excepthook__


def test_unknown_format_is_rejected(restore_root_logger):
    with pytest.raises(ValueError, match="unknown log format 'yaml'"):
        setup_logging("info", None, service="x", fmt="yaml")


def test_log_format_config_key_and_environment(monkeypatch):
    from gyre.config import ConfigError, load_config
    from gyre.config.inference import InferenceConfig

    monkeypatch.setenv("GYRE_LOG__FORMAT", "JSON")  # a container's form; any case
    assert load_config(InferenceConfig, []).log.format == "json"
    monkeypatch.delenv("GYRE_LOG__FORMAT")
    assert load_config(InferenceConfig, []).log.format == "text"  # the default, locally
    with pytest.raises(ConfigError, match=r"log\.format"):
        load_config(InferenceConfig, ["--log.format", "yaml"])


def test_launchers_read_json_lines():
    from gyre.inference_process import parse_ready, ready_line
    from gyre.proc import _trouble

    record = json.dumps({"level": "INFO", "message": ready_line("http://h:1", "h:2", 5)})
    assert parse_ready(record).url == "http://h:1" and parse_ready(record).version == 5
    assert parse_ready('{"message": "starting"}') is None and parse_ready("{not json") is None
    assert _trouble(json.dumps({"level": "ERROR", "message": "x"})) and not _trouble(json.dumps({"level": "INFO"}))
    assert _trouble("2026-11-22T06:01:02.345Z WARNING trainer x: y") and not _trouble("... INFO trainer x: y")
