"""Filesystem faults for tests: a volume that cannot take a large file."""

from __future__ import annotations

import contextlib
import resource


@contextlib.contextmanager
def file_size_limit(max_bytes: int):
    """Writes past `max_bytes` in any file of this process fail with EFBIG (`RLIMIT_FSIZE`) while inside: what a
    full volume does to a writer, without root or a small mount. Python ignores SIGXFSZ, so it is an OSError."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
