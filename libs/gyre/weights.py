"""Weights versions and the folder store behind the `folder` transport, `{output_dir}/weights/step_{s}/`.

`WeightsVersion` (step, digest, transport, locator) is the one description of a published version:
the trainer's sink returns it, NotifyWeights and UpdateWeights carry it (`gyre.v1.WeightsVersion`),
the relay targets it and a replica's source fetches it (see `gyre.transport` for the seam).

Invariants of the store (what readers may rely on):
- A `step_{s}` folder exists only complete: the trainer writes into `.tmp-step_{s}-<uuid>/`, adds
  `MANIFEST.json` (sha256 and size of every file), fsyncs the files and the folder, then renames it.
  A publisher killed at any moment leaves at most a `.tmp-*` folder that `steps()`/`latest()` ignore
  and `prune()` removes once stale.
- The weights **digest** is the sha256 of the MANIFEST.json bytes. The files are hashed once, by the
  publisher; a reader checks the digest and every file's size (`verify`, cheap: the rename makes a
  folder complete, so a size check catches truncation by outside interference) and re-hashes every
  file only when asked (`full=True`).
- Versions that a holder (e.g. the orchestrator, for replicas still serving them) declared in use
  via `set_in_use` are never pruned, nor is the latest one.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from gyre.fsio import commit_dir, fsync_files, write_atomic, write_file
from gyre.steps import StepEntries, check_step

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
IN_USE_DIR = ".in_use"
_HOLDER = re.compile(r"^[A-Za-z0-9_.-]+$")


class WeightsError(RuntimeError):
    """A weights version is missing, incomplete or corrupt (or does not match its digest)."""


FOLDER = "folder"
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class WeightsVersion:
    """A published weights version: `locator` says where it is in `transport`'s terms."""

    step: int
    digest: str  # sha256 of the version's manifest ("" = unknown / do not check)
    transport: str = FOLDER
    locator: str = ""  # folder: the step_{step} folder

    @property
    def path(self) -> Path:
        """The folder of a `folder` version."""
        if self.transport != FOLDER:
            raise WeightsError(f"weights step {self.step} travel by {self.transport!r}, not as a folder")
        return Path(self.locator)

    def to_proto(self):
        from gyre.v1 import weights_pb2

        return weights_pb2.WeightsVersion(
            step=self.step, digest=self.digest, transport=self.transport, locator=self.locator
        )

    @classmethod
    def from_proto(cls, message) -> WeightsVersion:
        """Validate a `gyre.v1.WeightsVersion`; ValueError names the bad field."""
        if message.step < 0:
            raise ValueError(f"version.step must be >= 0, got {message.step}")
        if message.digest and not _DIGEST.match(message.digest):
            raise ValueError(f"version.digest must be 64 lowercase hex digits (a sha256), got {message.digest!r}")
        return cls(
            step=int(message.step), digest=message.digest, transport=message.transport or FOLDER,
            locator=message.locator,
        )  # fmt: skip


@dataclass(frozen=True)
class Manifest:
    step: int
    files: dict[str, dict]  # relative posix name -> {"sha256": hex, "bytes": int}
    created: float

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        try:
            doc = json.loads(data)
            files = doc["files"]
            manifest = cls(step=int(doc["step"]), files=dict(files), created=float(doc["created"]))
            for name, meta in files.items():
                if not isinstance(meta["sha256"], str) or not isinstance(meta["bytes"], int):
                    raise TypeError(name)
        except (ValueError, KeyError, TypeError) as e:
            raise WeightsError(f"malformed {MANIFEST}: {type(e).__name__}: {e}") from None
        return manifest


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class WeightStore:
    """Atomic publish / verify / latest / retention of weight versions under `root`."""

    def __init__(self, root: Path | str, *, stale_tmp_s: float = 60.0):
        self.root = Path(root)
        self.stale_tmp_s = stale_tmp_s
        self.entries = StepEntries(self.root, marker=MANIFEST)  # complete versions: a manifest inside

    def path(self, step: int) -> Path:
        return self.entries.path(step)

    # ---- publishing -----------------------------------------------------------------------------
    def version(self, step: int) -> WeightsVersion:
        """The published version `step` as a `WeightsVersion` (WeightsError if missing or incomplete)."""
        return WeightsVersion(step, self.digest(step), FOLDER, str(self.path(step)))

    def publish(self, step: int, write_fn: Callable[[Path], Mapping[str, str] | None]) -> WeightsVersion:
        """Make version `step` from the files `write_fn(folder)` writes; returns its path and digest.

        `write_fn` may return {relative posix name: sha256} of files it hashed while writing them
        (`gyre.fsio.write_hashed`: the large weights file is then never read back); the store hashes the
        others. Republishing an existing step with identical files is a no-op that returns the existing
        digest (a trainer restarted after publishing but before acking); different files replace it.
        """
        check_step(step)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-step_{step}-{uuid.uuid4().hex}"
        tmp.mkdir()
        # held while we work: prune() of another process skips a tmp folder that is still locked
        lock_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            hashed = write_fn(tmp)
            hashed = dict(hashed) if isinstance(hashed, Mapping) else {}
            if (tmp / MANIFEST).exists():
                raise WeightsError(f"write_fn must not write {MANIFEST} itself")
            written = sorted(p for p in tmp.rglob("*") if p.is_file())
            if not written:
                raise WeightsError(f"write_fn wrote no files for step {step}")
            names = {f.relative_to(tmp).as_posix(): f for f in written}
            if hashed.keys() - names.keys():
                raise WeightsError(
                    f"write_fn returned hashes of files it did not write: {sorted(hashed.keys() - names.keys())}"
                )
            # Durability costs journal commits, not bytes: the manifest, the files (flushed while written by
            # `fsio.write_hashed`) and the folders are fsynced together, sharing one commit; the rename needs
            # one more. Files the writer did not hash are hashed here first, from the page cache.
            files = {name: {"sha256": hashed.get(name) or _sha256_file(f), "bytes": f.stat().st_size}
                     for name, f in names.items()}  # fmt: skip
            manifest = json.dumps({"step": step, "files": files, "created": time.time()}, indent=1, sort_keys=True)
            # no temp name needed: nothing in `tmp` is visible before the folder's rename
            write_file(tmp / MANIFEST, manifest.encode())
            fsync_files([tmp / MANIFEST, *written, *{p.parent for p in tmp.rglob("*")}])
            final = self.path(step)
            if final.exists() and self._same_files(final, files):
                shutil.rmtree(tmp)
                return self.version(step)
            # an old version is moved out of the way first: at no instant is an incomplete step_{s} visible
            commit_dir(tmp, final, synced=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            os.close(lock_fd)
        published = WeightsVersion(step, hashlib.sha256(manifest.encode()).hexdigest(), FOLDER, str(final))
        log.info("published weights step %d at %s (digest %s)", step, final, published.digest[:12])
        return published

    def _same_files(self, folder: Path, files: dict) -> bool:
        try:
            return Manifest.from_bytes((folder / MANIFEST).read_bytes()).files == files
        except (OSError, WeightsError):
            return False

    def discard_after(self, step: int) -> list[int]:
        """Delete versions newer than `step` (a rewound run abandons them), each hidden by a rename first."""
        return self.entries.discard_after(step)

    # ---- reading --------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Complete versions (folder with a manifest), ascending."""
        return self.entries.steps()

    def latest(self) -> int | None:
        return self.entries.latest()

    def _manifest_bytes(self, step: int) -> bytes:
        try:
            return (self.path(step) / MANIFEST).read_bytes()
        except FileNotFoundError:
            state = "incomplete" if self.path(step).is_dir() else "missing"
            raise WeightsError(f"weights step {step} are {state} ({self.path(step)})") from None

    def digest(self, step: int) -> str:
        return hashlib.sha256(self._manifest_bytes(step)).hexdigest()

    def verify(self, step: int, digest: str | None = None, *, full: bool = True) -> Manifest:
        """Check the manifest (against `digest` if given) and every file's size; with `full`, also
        every file's sha256 (reads every byte: replicas skip it by default, the publisher hashed once)."""
        data = self._manifest_bytes(step)
        if digest is not None and hashlib.sha256(data).hexdigest() != digest:
            raise WeightsError(f"weights step {step}: manifest digest differs from the announced {digest}")
        manifest = Manifest.from_bytes(data)
        if manifest.step != step:
            raise WeightsError(f"weights step {step}: manifest says step {manifest.step}")
        folder = self.path(step)
        for name, meta in manifest.files.items():
            file = folder / name
            if not file.is_file():
                raise WeightsError(f"weights step {step}: file {name} is missing")
            if file.stat().st_size != meta["bytes"]:
                size = file.stat().st_size
                raise WeightsError(f"weights step {step}: file {name} has {size} bytes, not {meta['bytes']}")
            if full and _sha256_file(file) != meta["sha256"]:
                raise WeightsError(f"weights step {step}: file {name} does not match its sha256")
        return manifest

    # ---- retention ------------------------------------------------------------------------------
    def set_in_use(self, holder: str, steps: Iterable[int]) -> None:
        """Declare (replacing any previous declaration) the versions `holder` still needs."""
        if not _HOLDER.match(holder):
            raise ValueError(f"holder {holder!r} must match {_HOLDER.pattern}")
        doc = {"holder": holder, "steps": sorted({check_step(s) for s in steps}), "updated": time.time()}
        write_atomic(self.root / IN_USE_DIR / f"{holder}.json", json.dumps(doc).encode())

    def in_use(self) -> set[int]:
        """Union of the versions every holder declared."""
        used: set[int] = set()
        folder = self.root / IN_USE_DIR
        if not folder.is_dir():
            return used
        for file in folder.glob("*.json"):
            try:
                used.update(int(s) for s in json.loads(file.read_bytes())["steps"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                # written atomically, so this is outside interference; say so loudly
                log.error("ignoring unreadable in-use file %s: %s", file, e)
        return used

    def prune(self, keep_last: int) -> list[int]:
        """Delete complete versions that are not among the newest `keep_last`, not in use and not
        the latest; also remove abandoned `.tmp-*` folders. Returns the deleted steps."""
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1 (the latest version is always kept)")
        deleted = self.entries.keep_only(set(self.steps()[-keep_last:]) | self.in_use())
        self._remove_stale_tmp()
        if deleted:
            log.info("pruned weights steps %s", deleted)
        return deleted

    def _remove_stale_tmp(self) -> None:
        now = time.time()
        for entry in os.scandir(self.root):
            if not (entry.name.startswith(".tmp-") and entry.is_dir(follow_symlinks=False)):
                continue
            path = Path(entry.path)
            try:
                newest = max([path.stat().st_mtime] + [p.stat().st_mtime for p in path.rglob("*")])
            except FileNotFoundError:
                continue  # being renamed or removed by its owner right now
            if now - newest < self.stale_tmp_s or _is_locked(path):
                continue
            shutil.rmtree(path, ignore_errors=True)


def _is_locked(folder: Path) -> bool:
    """True while a live publisher holds the folder's flock (same-host publishers)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)
