"""setup_logging: one-line format to stderr and a file, idempotent, strict about levels."""

from __future__ import annotations

import logging
import re

import pytest
from gyre.logging import setup_logging

LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (\w+) (\S+) ([\w.]+): (.*)$")


@pytest.fixture
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)


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
