"""Logging setup shared by every service: one line per record, to stderr and optionally a file.

Format: `2026-11-22T06:01:02.345Z INFO trainer gyre_trainer.loop: trained step 3` — UTC ISO time,
level, service, logger name, message. One line per record (tracebacks are appended on the following
lines, as usual) so `kubectl logs` and `{output_dir}/logs/{service}.log` grep the same way.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

_MARK = "_gyre_handler"  # handlers we installed, so a second setup_logging replaces instead of duplicating


class _Formatter(logging.Formatter):
    converter = time.gmtime

    def __init__(self, service: str):
        super().__init__(fmt=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 (stdlib API)
        return time.strftime("%Y-%m-%dT%H:%M:%S", self.converter(record.created)) + f".{int(record.msecs):03d}Z"


def setup_logging(level: str = "INFO", file: Path | str | None = None, service: str = "gyre") -> logging.Logger:
    """Configure the root logger; idempotent (re-running replaces the handlers it added before).

    `level` is a standard level name (case-insensitive); an unknown one raises ValueError.
    """
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING, ERROR or CRITICAL")
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, _MARK, False)]:
        root.removeHandler(handler)
        handler.close()
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if file is not None:
        Path(file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(file, encoding="utf-8"))
    formatter = _Formatter(service)
    for handler in handlers:
        handler.setFormatter(formatter)
        setattr(handler, _MARK, True)
        root.addHandler(handler)
    root.setLevel(numeric)
    # chatty third-party loggers (a line per HTTP request) stay at WARNING unless we debug
    for noisy in ("httpx", "httpx2", "httpcore", "httpcore2", "urllib3", "filelock"):  # openai 3.x uses httpx2
        logging.getLogger(noisy).setLevel(logging.NOTSET if numeric <= logging.DEBUG else max(numeric, logging.WARNING))
    return root
