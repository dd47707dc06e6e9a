"""Child processes that die with their parent (one home for PR_SET_PDEATHSIG)."""

from __future__ import annotations

import contextlib
import ctypes
import signal


def set_pdeathsig(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent thread dies (Linux; else a no-op).

    Meant as a `preexec_fn` (runs in the child between fork and exec), so a SIGKILLed parent leaves
    no orphans. The signal follows the death of the *thread* that forked: start children from a
    thread that outlives them (the main thread, in practice).
    """
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
