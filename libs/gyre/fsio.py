"""Crash-safe writes for the shared volume: readers see nothing, or the complete file or folder.

The one home of the durability primitives: `fsync_file` / `fsync_dir` / `fsync_files`, `write_atomic`
(a file), `write_file` / `write_hashed` (files inside a folder committed as a whole) and `commit_dir`
(a folder written under a temp name: weight versions, trainer checkpoints, HF model saves). Temp and
retired names start with `.tmp-`, which every reader of a folder of versions ignores and its cleaner
removes once stale.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsync a directory so that renames/creations inside it survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """fsync a file (written by someone else, e.g. `save_file`) or a folder."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_files(paths: Iterable[Path]) -> None:
    """fsync many files or folders at once: concurrent fsyncs share the filesystem's journal commits
    (ext4, xfs), so a folder of N files costs about one flush instead of N. The threads are kept between
    calls: starting ten of them cost ~2 ms, a tenth of publishing a small model's version."""
    paths = list(paths)
    if len(paths) <= 1:
        for path in paths:
            fsync_file(path)
        return
    for _ in _fsync_pool(os.getpid()).map(fsync_file, paths):  # re-raises the first error
        pass


@functools.cache
def _fsync_pool(pid: int) -> ThreadPoolExecutor:
    """The fsync threads of process `pid` (a forked child gets its own: threads do not survive a fork)."""
    return ThreadPoolExecutor(16, thread_name_prefix="fsync")


def write_file(path: Path, data: bytes, mode: int = 0o644) -> Path:
    """Create `path` with `data`, not fsynced, not atomic: for files inside a folder that is fsynced
    and then renamed into view as a whole (`write_atomic` otherwise). `mode` as in `write_atomic`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)  # regardless of the umask
        f.write(data)
    return Path(path)


# write_hashed: the write size, the flush interval and the size from which writing, hashing and flushing overlap
_FLUSH_BYTES = 32 << 20


def write_hashed(path: Path, chunks: Sequence[bytes | memoryview], mode: int = 0o644) -> str:
    """Create `path` with the concatenated `chunks` and return its sha256; not fsynced, as `write_file`
    (for files of a folder that is fsynced and renamed into view as a whole).

    From `_FLUSH_BYTES` on, three things overlap instead of following each other: this thread writes, a
    second one hashes the same buffers (both release the GIL; no byte is read back), and a third flushes
    what is already written (`fdatasync` every `_FLUSH_BYTES`), so the folder's fsync only waits for the
    tail. Smaller files are written, then hashed, in this thread: on a busy machine handing work to
    other threads costs more than hashing a few MB."""
    overlap = sum(memoryview(chunk).nbytes for chunk in chunks) >= _FLUSH_BYTES
    with ThreadPoolExecutor(2) if overlap else contextlib.nullcontext() as pool:
        digest = pool.submit(_sha256_of, chunks) if overlap else None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        flushing = None
        try:
            os.fchmod(fd, mode)  # regardless of the umask
            unflushed = 0
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                while view:  # a write may be short (Linux caps one write at ~2 GiB)
                    written = os.write(fd, view[:_FLUSH_BYTES])
                    view, unflushed = view[written:], unflushed + written
                    if overlap and unflushed >= _FLUSH_BYTES and (flushing is None or flushing.done()):
                        flushing, unflushed = pool.submit(os.fdatasync, fd), 0
            start_writeback(fd)  # the rest gets to the disk while the hash finishes
        finally:
            if flushing is not None:
                flushing.result()
            os.close(fd)
        return digest.result() if overlap else _sha256_of(chunks)


_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h


@functools.cache
def _sync_file_range():
    """libc's `sync_file_range` (Linux; Python's os module does not wrap it), or None."""
    function = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


def start_writeback(fd: int) -> None:
    """Start writing `fd`'s dirty pages to the disk now, without waiting and without a journal commit.
    Not a durability guarantee: the folder's fsync still makes the file durable, it just finds less left
    to flush (the commit it pays for comes sooner). A no-op where unsupported."""
    function = _sync_file_range()
    if function is not None:
        function(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # 0, 0: the whole file; a failure only loses the head start


def _sha256_of(chunks: Sequence[bytes | memoryview]) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def sync_tree(folder: Path) -> None:
    """fsync `folder`, every folder and every file under it, all together (see `fsync_files`)."""
    folder = Path(folder)
    fsync_files([*folder.rglob("*"), folder])


def retire_dir(folder: Path) -> None:
    """Hide `folder` atomically (a rename to a `.tmp-delete-*` sibling, made durable), then delete it.

    No reader ever sees a half-deleted folder under its real name."""
    folder = Path(folder)
    doomed = folder.parent / f".tmp-delete-{folder.name}-{uuid.uuid4().hex}"
    os.rename(folder, doomed)
    fsync_dir(folder.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def commit_dir(tmp: Path, final: Path, *, synced: bool = False) -> Path:
    """Make the folder written at `tmp` (a sibling of `final`) visible as `final`, only complete.

    fsyncs everything in `tmp` (skip with `synced` when the caller already did), retires an existing
    `final`, renames and fsyncs the parent. Invariant: at every instant `final` is absent, its previous
    complete content or the new complete content, also after a crash.
    """
    tmp, final = Path(tmp), Path(final)
    if not synced:
        sync_tree(tmp)
    if final.exists():
        retire_dir(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    return final


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> Path:
    """Write `data` to `path` via a temp file in the same folder, fsync, rename, fsync the folder.

    Invariant: at every instant `path` is either absent, its previous content, or exactly `data`.
    `mode` defaults to world-readable (mkstemp's 0600 would hide manifests from inference pods that
    run as another user of the volume's group).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def free_space(folder: Path) -> str:
    """How full the volume holding `folder` is, for an error message (a full volume is the usual cause)."""
    try:
        usage = shutil.disk_usage(folder if folder.exists() else folder.parent)
    except OSError:
        return "free space unknown"
    return f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB on its volume"
