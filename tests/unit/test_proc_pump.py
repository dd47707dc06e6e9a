"""A child's output is read to its end whatever happens to the console it is echoed to.

`Child` pumps the child's stdout+stderr into its log and echoes warnings to the console from one thread. An echo
that raised (the console a closed pipe: `gyre rl ... | head`, or `| tee` that a Ctrl-C ended first) ended that
thread: nothing read the pipe any more, and once it held 64 KiB the child blocked in a write for ever (a service
mid-stop blocked until SIGKILL, its stop checkpoint lost).
"""

from __future__ import annotations

import sys

from gyre.proc import Child

# 200 warnings of 1 KiB: three times what a pipe holds
LOUD = "import sys\nfor i in range(200):\n    print(f'2026-01-01 WARNING line {i} ' + 'x' * 1000, flush=True)\n"


def _closed_console(text: str) -> None:
    raise BrokenPipeError(32, "Broken pipe")


def test_a_child_is_read_to_its_end_when_the_console_is_gone(tmp_path):
    child = Child("loud", [sys.executable, "-c", LOUD], tmp_path / "loud.log", console=_closed_console)
    child.start()
    try:
        assert child.wait(timeout=60) == 0  # TimeoutExpired: blocked writing to a pipe nobody reads
    finally:
        child.kill()
    log = child.log()
    assert "line 0 " in log and "line 199 " in log


def test_a_failing_line_callback_does_not_stop_the_reading(tmp_path):
    seen = []

    def on_line(line: str) -> None:
        seen.append(line)
        raise ValueError("a bug in a callback")

    child = Child("loud", [sys.executable, "-c", LOUD], tmp_path / "loud.log", on_line=on_line)
    child.start(quiet=True)
    try:
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
    assert len(seen) == 200 and "line 199 " in child.log()
