"""How many CPU threads the torch engine should use by default: what the container may really use.

torch's default is every core it can see, and under a Kubernetes CPU limit it still sees every core of
the node: a pod limited to 2 CPUs on a 64-core node runs 64 OpenMP threads that the kernel throttles
in turns, which measured ~8x slower than 1 thread (2.8 vs 22.1 requests/s). The usable CPUs are the
smallest of: the CPUs this process may run on (affinity / cpuset), and the cgroup CPU quota
(cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us / cpu.cfs_period_us`), rounded up. One of them is left
to the event loop that serves HTTP, tokenizes and detokenizes, so the default is that minus one
(at least 1).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs allowed by the cgroup quota, or None when unlimited (or no cgroup CPU controller is visible)."""
    v2 = root / "cpu.max"
    if v2.is_file():
        quota, _, period = v2.read_text().strip().partition(" ")
        if quota == "max" or not period:
            return None
        return int(quota) / int(period)
    quota_file, period_file = root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us"
    if quota_file.is_file() and period_file.is_file():
        quota, period = int(quota_file.read_text()), int(period_file.read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    return None


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """CPUs this process can actually use: affinity, capped by the cgroup quota (rounded up)."""
    visible = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        limit = cgroup_cpu_limit(root)
    except (OSError, ValueError):  # unreadable or unexpected cgroup files: trust affinity alone
        limit = None
    return max(1, min(visible, math.ceil(limit)) if limit is not None else visible)


def default_engine_threads(root: Path = CGROUP_ROOT) -> int:
    """The engine's torch threads when `engine.threads` is unset: usable CPUs minus one for the HTTP loop."""
    return max(1, usable_cpus(root) - 1)
