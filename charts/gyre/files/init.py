# The chart's init containers (model-fetch, model-init, wait-for-model), run as
#   python3 -c "<this file>" CONTAINER RUN_ID fetch|init|wait [gyre model fetch arguments]
# Every line they print is a record of Gyre's own log format (gyre/logging.py, `GYRE_LOG__FORMAT` /
# `GYRE_LOG__LEVEL` from `experiment.log`): with `json`, one JSON object per line with the fields of the
# services' records (service = the container's name), so a collector keeps and filters them as the services'
# lines; a `sh -c` loop's echo and `gyre model ...`'s prints were bare text in a JSON release.
# SIGTERM keeps its default action (the process ends at once, tini exits 143): the wait loops hold no pod.
import contextlib
import io
import json
import logging
import os
import sys
import time

from gyre.logging import setup_logging

container, run_id, action, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
setup_logging(os.environ.get("GYRE_LOG__LEVEL") or "INFO", service=container,
              fmt=os.environ.get("GYRE_LOG__FORMAT") or "text", run_id=run_id or None)  # fmt: skip
log = logging.getLogger("gyre.init")


# A progress bar is a line per update in a log (JSON mode turns them off already): the fetch logs its result.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


class Lines(io.TextIOBase):
    """A stdout / stderr whose every printed line is a record: `gyre model ...` prints its result and errors."""

    encoding = "utf-8"

    def __init__(self, level, stream):
        self.level, self.stream, self.pending = level, stream, ""

    def writable(self):
        return True

    def write(self, text):
        *lines, self.pending = (self.pending + text).replace("\r", "\n").split("\n")
        for line in filter(str.strip, lines):
            # `gyre <command>: error: ...` (its refusals, exit 1 or 2) is an error whatever the stream
            level, message = logging.ERROR if ": error:" in line else self.level, line.rstrip()
            if line.startswith("{"):  # a record the command wrote itself (a start-up error under JSON logs)
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict) and "message" in record:  # its level and message, not nested
                        named = logging.getLevelName(str(record.get("level")))  # a number for a known name
                        level = named if isinstance(named, int) else level
                        message = str(record["message"])
            log.log(level, message)
        return len(text)

    def fileno(self):  # a library writing to the descriptor itself bypasses the records, as it would anyway
        return self.stream.fileno()


def gyre(*argv):
    """A `gyre` command in this process, its prints as records; its exit code."""
    from gyre.cli import main

    sys.stdout, sys.stderr = Lines(logging.INFO, sys.__stdout__), Lines(logging.WARNING, sys.__stderr__)
    try:
        return main(list(argv))
    except SystemExit as stop:  # its argument parser's refusal (the message went through stderr)
        return stop.code if isinstance(stop.code, int) else 2
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.write("\n")  # a last line printed without its newline
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__


def wait_for_model(model_dir, maker):
    """Until `model_dir` holds a model (config.json: `gyre model init` writes aside and renames, so it is whole)."""
    config, started, said = os.path.join(model_dir, "config.json"), time.monotonic(), None
    while not os.path.isfile(config):
        waited = int(time.monotonic() - started)
        if said is None or waited - said >= 60:  # a line a minute, not one per poll
            log.info("waiting for %s (created by %s), %d s so far", model_dir, maker, waited)
            said = waited
        time.sleep(5)
    log.info("model ready: %s", model_dir)


if action == "fetch":
    sys.exit(gyre("model", "fetch", *args))
model_dir = os.environ["MODEL_DIR"]
pod_zero = os.environ.get("POD_NAME", "").rsplit("-", 1)[-1] == "0"
if action == "init" and pod_zero and not os.path.isfile(os.path.join(model_dir, "config.json")):
    # Pod 0 creates the model once (an existing one is kept); the other pods wait for it.
    code = gyre("model", "init", "--output-dir", model_dir, "--preset", os.environ["MODEL_PRESET"],
                "--seed", os.environ["MODEL_SEED"])  # fmt: skip
    if code:
        sys.exit(code)
wait_for_model(model_dir, "trainer pod 0")
