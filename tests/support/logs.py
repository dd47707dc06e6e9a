"""What named loggers log during a block, whatever their handlers: transformers' own writes to a stream that pytest
may not capture (it is bound at import) and does not propagate until Gyre's logging setup says so."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]):
        super().__init__(logging.DEBUG)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def logged(*names: str) -> Iterator[list[str]]:
    """The messages the loggers `names` (and their children) log inside the block, in order."""
    lines: list[str] = []
    handler = _Lines(lines)
    for name in names:
        logging.getLogger(name).addHandler(handler)
    try:
        yield lines
    finally:
        for name in names:
            logging.getLogger(name).removeHandler(handler)
