"""Another process holding a run folder's lock, as a running `gyre rl`, trainer, orchestrator or `gyre sft` does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def hold_run_lock(folder: Path, role: str, info: dict | None = None) -> subprocess.Popen:
    """A process holding `role`'s lock on `folder` (`gyre.runlock.RunLock`, with `info` for others to read) until
    killed; its pid is the holder's."""
    code = (
        "import json, sys; from gyre.runlock import RunLock; "
        "RunLock(sys.argv[1], sys.argv[2]).acquire(info=json.loads(sys.argv[3])); print('held', flush=True); input()"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(folder), role, json.dumps(info or {})],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    return holder
