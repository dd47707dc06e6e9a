"""torchrun for the trainer: the same launcher, but a clean stop on SIGTERM/SIGINT exits 0, not 1.

    python -m gyre_trainer.torchrun --standalone --nproc-per-node 2 -m gyre.cli trainer @ exp.toml#trainer

Every argument is torchrun's (`torch.distributed.run`). On SIGTERM torchrun forwards the signal to its workers,
waits for them (up to `--shutdown-timeout`), then raises `SignalException` and exits 1 with its traceback, whatever
the workers did: a trainer that finished its step, saved its stop checkpoint and returned 0 on every rank looked
like a crash to Kubernetes, `gyre rl` and anyone reading the exit code. Here each worker leaves its exit status in
a folder this launcher made (`STATUS_ENV`; `report_exit`, called by `gyre trainer` on its way out), and a
`SignalException` after which every local worker reported 0 exits 0, logging that the stop was clean. Anything
else is torchrun's own outcome, unchanged: a worker that failed, was killed at the end of the shutdown timeout or
had not started yet (the signal came during the rendezvous) still exits 1 with torchrun's traceback.

torchrun starts each worker in a session of its own, out of reach of a signal to torchrun's process group: a
SIGKILLed torchrun (`gyre rl`'s second Ctrl-C, the end of its stop timeout) left its ranks running. Each worker
of this launcher asks the kernel for a SIGKILL when torchrun dies (`follow_launcher`), as a crash would have it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

#: the folder where the workers of this launcher leave their exit status (one file per local rank)
STATUS_ENV = "GYRE_TORCHRUN_STATUS_DIR"
#: the launcher's pid: its workers die with it (`follow_launcher`)
LAUNCHER_ENV = "GYRE_TORCHRUN_PID"


def follow_launcher() -> None:
    """A worker of this launcher is SIGKILLed when the launcher dies (no-op outside `gyre_trainer.torchrun`)."""
    launcher = os.environ.pop(LAUNCHER_ENV, None)  # popped: a process this worker starts is not torchrun's
    if not launcher or "LOCAL_RANK" not in os.environ:
        return
    from gyre.proc import alive, set_pdeathsig

    set_pdeathsig(signal.SIGKILL)  # torchrun forks its workers from its main thread: its death, not a thread's
    if os.getppid() != int(launcher) and not alive(int(launcher)):  # gone before the request: nothing is sent
        os.kill(os.getpid(), signal.SIGKILL)


def report_exit(code: int) -> None:
    """A worker's exit status, for the launcher that started it (no-op outside `gyre_trainer.torchrun`)."""
    folder = os.environ.get(STATUS_ENV)
    if not folder or "LOCAL_RANK" not in os.environ:
        return
    status = {"code": int(code), "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1"))}
    # OSError: the launcher is gone or its folder with it: nobody reads it, torchrun's own status stands
    with contextlib.suppress(OSError):
        (Path(folder) / f"local_rank_{int(os.environ['LOCAL_RANK'])}.json").write_text(json.dumps(status))


def run_worker(main: Callable[[list[str] | None], int], argv: list[str] | None) -> int:
    """`main(argv)` as a worker of this launcher (`gyre trainer`, `gyre sft`): it dies with the launcher, even
    SIGKILLed (torchrun puts it in a session of its own), and leaves its exit status, so a clean stop on SIGTERM
    exits 0, not torchrun's 1. Outside `python -m gyre_trainer.torchrun` it is `main(argv)`."""
    follow_launcher()
    code = main(argv)
    report_exit(code)
    return code


def clean_stop(folder: Path) -> bool:
    """Whether every local worker reported exit status 0 (all of them: `local_world_size` files, none missing)."""
    statuses = []
    for file in folder.glob("local_rank_*.json"):
        try:
            statuses.append(json.loads(file.read_text()))
        except (OSError, ValueError):
            return False
    if not statuses:
        return False
    expected = {s.get("local_world_size") for s in statuses}
    return len(expected) == 1 and len(statuses) == expected.pop() and all(s.get("code") == 0 for s in statuses)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    folder = Path(tempfile.mkdtemp(prefix="gyre-torchrun-"))
    os.environ[STATUS_ENV] = str(folder)  # the workers inherit the launcher's environment
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    try:
        torchrun(sys.argv[1:] if argv is None else list(argv))
        return 0
    except SignalException as e:
        if not clean_stop(folder):
            raise
        print(f"gyre_trainer.torchrun: {e}: every worker stopped cleanly, exit 0", file=sys.stderr, flush=True)
        return 0
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
