"""Logging setup shared by every service: one line per record, to stderr and optionally a file.

`log.format = "text"` (the default): `2026-11-22T06:01:02.345Z INFO trainer gyre_trainer.loop: trained step 3`
— UTC ISO time, level, service, logger name, message; a traceback follows on the next lines, as usual, so
`kubectl logs` and `{output_dir}/logs/{service}.log` grep the same way.

`log.format = "json"` (the Helm chart's default): one JSON object per line, traceback included, for log
collectors (Loki, Elasticsearch, Cloud Logging) that would otherwise split a traceback into one entry per line:

    {"time": "2026-11-22T06:01:02.345Z", "level": "INFO", "severity": "INFO", "service": "trainer",
     "run_id": "exp1", "logger": "gyre_trainer.loop", "message": "trained step 3", "step": 3}

`level` is what Loki's detected_level, Elasticsearch and structlog read; `severity` is what Cloud Logging reads
(without it every stderr line is an ERROR there); `time` is RFC 3339, which Cloud Logging takes as the entry's
time. `exception` holds a record's formatted traceback, `stack` its stack_info. Fields given with
`extra={...}` (`step`, ...) are added as they are (a value JSON cannot hold as its string).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

_MARK = "_gyre_handler"  # handlers we installed, so a second setup_logging replaces instead of duplicating


class _Formatter(logging.Formatter):
    converter = time.gmtime

    def __init__(self, service: str):
        super().__init__(fmt=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 (stdlib API)
        return time.strftime("%Y-%m-%dT%H:%M:%S", self.converter(record.created)) + f".{int(record.msecs):03d}Z"


# A LogRecord's own attributes; any other one came from `extra=` and is written as a field of its own.
# uvicorn's color_message is its message again, with terminal colour codes.
_RECORD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName", "color_message"}


class _JsonFormatter(_Formatter):
    def __init__(self, service: str, run_id: str | None = None):
        super().__init__(service)
        self._fixed = {"service": service} | ({"run_id": run_id} if run_id else {})

    def format(self, record: logging.LogRecord) -> str:
        level = record.levelname
        entry: dict[str, Any] = {"time": self.formatTime(record), "level": level,
                                 "severity": "WARNING" if level == "WARN" else level, **self._fixed,
                                 "logger": record.name, "message": record.getMessage()}  # fmt: skip
        if record.exc_info:
            record.exc_text = record.exc_text or self.formatException(record.exc_info)
        if record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRIBUTES and key not in entry:
                entry[key] = value
        # default=str: an extra that JSON cannot hold (a Path, a tensor) is its string, never a lost record
        return json.dumps(entry, ensure_ascii=False, default=str)


def json_record(
    service: str, message: str, level: str = "ERROR", logger: str = "gyre", run_id: str | None = None
) -> str:
    """One line as `log.format = "json"` writes a record, for what a command prints before logging is set up (a
    start-up error: `gyre.config.command_line.parse_or_exit`), so a collector reading JSON gets a record, not bare
    text."""
    record = logging.makeLogRecord({"name": logger, "levelname": level, "levelno": logging.getLevelName(level),
                                    "msg": message})  # fmt: skip
    return _JsonFormatter(service, run_id).format(record)


def _log_uncaught(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """sys.excepthook in JSON mode: a crash's traceback is one JSON record too, not lines a collector splits."""
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)
        return
    logging.getLogger("gyre").critical("uncaught exception, exiting", exc_info=(kind, value, tb))


def _route_library_output() -> None:
    """JSON mode: what libraries print beside the logging tree comes through it, or not at all."""
    logging.captureWarnings(True)  # warnings.warn(...) lines are records, not bare stderr text
    # vLLM's loggers have their own text handler unless told not to; then they reach ours (read at its import)
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    # progress bars (transformers' "Loading weights", hub downloads) are terminal output, one line per update in
    # a log file: off (read when transformers / huggingface_hub are imported, which the services do after this)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if importlib.util.find_spec("transformers") is not None:
        from transformers.utils import logging as hf_logging

        # transformers writes its warnings with a text handler of its own and stops them there; to ours instead
        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()


def _drop_hub_handler() -> None:
    """huggingface_hub gives its loggers a stderr handler of its own at import, and they propagate to ours too: each
    of its warnings (a hub request retried, 10 while a model is looked up offline) was printed twice, once as bare
    text that a JSON collector cannot parse. Imported now (milliseconds, no torch) so the handler exists to drop."""
    if importlib.util.find_spec("huggingface_hub") is None:
        return
    import huggingface_hub.utils.logging  # noqa: F401 (adds the handler)

    hub = logging.getLogger("huggingface_hub")
    for handler in [h for h in hub.handlers if not getattr(h, _MARK, False)]:
        hub.removeHandler(handler)


def setup_logging(
    level: str = "INFO",
    file: Path | str | None = None,
    service: str = "gyre",
    fmt: str = "text",
    run_id: str | None = None,
) -> logging.Logger:
    """Configure the root logger; idempotent (re-running replaces the handlers it added before).

    `level` is a standard level name (case-insensitive); an unknown one raises ValueError. `fmt` is "text" or
    "json" (module docstring); `run_id` is a field of every JSON record.
    """
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING, ERROR or CRITICAL")
    if fmt not in ("text", "json"):
        raise ValueError(f"unknown log format {fmt!r}; use text or json")
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, _MARK, False)]:
        root.removeHandler(handler)
        handler.close()
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if file is not None:
        Path(file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(file, encoding="utf-8"))
    formatter = _JsonFormatter(service, run_id) if fmt == "json" else _Formatter(service)
    if fmt == "json":
        sys.excepthook = _log_uncaught
        _route_library_output()
    elif sys.excepthook is _log_uncaught:
        sys.excepthook = sys.__excepthook__
        logging.captureWarnings(False)
    for handler in handlers:
        handler.setFormatter(formatter)
        setattr(handler, _MARK, True)
        root.addHandler(handler)
    _drop_hub_handler()
    root.setLevel(numeric)
    # chatty third-party loggers (a line per HTTP request) stay at WARNING unless we debug
    for noisy in ("httpx", "httpx2", "httpcore", "httpcore2", "urllib3", "filelock"):  # openai 3.x uses httpx2
        logging.getLogger(noisy).setLevel(logging.NOTSET if numeric <= logging.DEBUG else max(numeric, logging.WARNING))
    return root
