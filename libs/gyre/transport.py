"""The weight-transport seam: how a trained version gets from the trainer to every inference replica.

Each transport has two sides, chosen by the services' `weights` config (`gyre.config.shared`, a union
on `kind`) and named in every `WeightsVersion` it produces (`version.transport`):

- the **store side**, used by the trainer as its sink (`publish` returns the `WeightsVersion` to
  announce; `version`, `latest`, `discard_after`, `prune` for resume and retention) and by the
  orchestrator's relay (`resolve` checks an announcement, `latest` finds missed ones, `hold` keeps
  versions that replicas still serve). `coordinated` tells the relay how to deliver: False = every
  replica fetches on its own (the relay runs one updater per replica, as for folders); True = one
  round that all replicas join (e.g. an NCCL broadcast; no such transport exists yet).
- the **source side**, used by each replica's UpdateWeights: `fetch(version)` returns a verified
  local folder the backend loads.

The `folder` transport is the shared volume (`gyre.weights.WeightStore`): exactly-once is kept by the
store (a step folder is renamed into view complete; its manifest is the commit record), and the files
are hashed once, by the trainer: replicas check sizes + the manifest digest, or re-hash with
`weights.full_verify`. A new transport adds a config member with its own `kind`, its two sides here,
and one branch in `open_store` / `open_source`.

The two sides are declared as Protocols (`WeightSink`, `WeightSource`): the trainer's publisher, the
orchestrator's relay, the replica's control server and its backends are typed against them and use nothing
else of a transport (no reaching into a store's folders). A backend loads what the source returns
(`FetchedWeights`), never a path it assumes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from gyre.weights import FOLDER, WeightsError, WeightStore, WeightsVersion

_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class FetchedWeights:
    """A version as a replica's source hands it to the backend: verified, local, ready to load.

    `folder`: the folder transport's `step_{s}` folder (a servable HF folder, or a PEFT adapter folder). A
    transport that delivers tensors some other way adds its own field here and its backends read that."""

    step: int
    folder: Path
    digest: str = ""

    @classmethod
    def local(cls, folder: Path | str, step: int = 0) -> FetchedWeights:
        """A folder on this machine as version `step` (the base model: step 0; tests)."""
        return cls(step, Path(folder))


@runtime_checkable
class WeightSink(Protocol):
    """The store side of a transport: the trainer publishes into it, the relay resolves announcements against
    it and holds the versions replicas still serve."""

    transport: str
    coordinated: bool  # False: every replica fetches on its own; True: one round all replicas join

    def publish(self, step: int, write_fn: Callable[[Path], Mapping[str, str] | None]) -> WeightsVersion:
        """Make version `step` from the files `write_fn(folder)` writes (atomically); the version to announce."""
        ...

    def version(self, step: int) -> WeightsVersion: ...

    def latest(self) -> int | None: ...

    def read(self, step: int, name: str) -> bytes:
        """A file published with version `step` (e.g. its step record); OSError or WeightsError if absent."""
        ...

    def discard_after(self, step: int) -> list[int]: ...

    def prune(self, keep_last: int) -> list[int]: ...

    def resolve(self, step: int, digest: str = "") -> WeightsVersion: ...

    def hold(self, holder: str, steps: Iterable[int]) -> None: ...

    def held(self) -> set[int]: ...


@runtime_checkable
class WeightSource(Protocol):
    """The source side of a transport: a replica checks an announced version, then fetches it for its backend."""

    transport: str

    def check(self, version: WeightsVersion) -> None:
        """Refuse a malformed announcement before any I/O (ValueError naming the field)."""
        ...

    def fetch(self, version: WeightsVersion) -> FetchedWeights: ...


class FolderStore:
    """The `folder` transport's store side: step folders under `root` on the shared volume."""

    transport = FOLDER
    coordinated = False

    def __init__(self, root: Path | str):
        self._store = WeightStore(root)

    # ---- trainer (sink) -------------------------------------------------------------------------
    def publish(self, step: int, write_fn: Callable[[Path], None]) -> WeightsVersion:
        return self._store.publish(step, write_fn)

    def version(self, step: int) -> WeightsVersion:
        return self._store.version(step)

    def latest(self) -> int | None:
        return self._store.latest()

    def read(self, step: int, name: str) -> bytes:
        return (self._store.path(step) / name).read_bytes()

    def discard_after(self, step: int) -> list[int]:
        return self._store.discard_after(step)

    def prune(self, keep_last: int) -> list[int]:
        return self._store.prune(keep_last)

    # ---- orchestrator (relay) -------------------------------------------------------------------
    def resolve(self, step: int, digest: str = "") -> WeightsVersion:
        """The version to relay for an announcement of `step` (WeightsError if this store does not hold
        it, or holds other files than announced: every replica would then fail the same way)."""
        version = self._store.version(step)
        if digest and digest != version.digest:
            raise WeightsError(
                f"weights step {step}: digest {digest[:12]}… differs from the manifest's {version.digest[:12]}…"
            )
        return version

    def hold(self, holder: str, steps: Iterable[int]) -> None:
        self._store.set_in_use(holder, steps)

    def held(self) -> set[int]:
        return self._store.in_use()


class FolderSource:
    """The `folder` transport's source side: a replica verifies the announced folder before loading it."""

    transport = FOLDER

    def __init__(self, *, full_verify: bool = False):
        self.full_verify = full_verify

    def check(self, version: WeightsVersion) -> None:
        """Reject a malformed announcement before any I/O (ValueError naming the field)."""
        match = _STEP_DIR.match(Path(version.locator).name) if version.locator else None
        if match is None or int(match.group(1)) != version.step:
            raise ValueError(
                f"version.locator must be a weights folder named step_{version.step} "
                f"(got locator={version.locator!r}, step={version.step})"
            )

    def fetch(self, version: WeightsVersion) -> FetchedWeights:
        """The verified folder of `version` (ValueError: a malformed locator; WeightsError: not intact)."""
        self.check(version)
        path = Path(version.locator)
        WeightStore(path.parent).verify(version.step, version.digest or None, full=self.full_verify)
        return FetchedWeights(version.step, path, version.digest)


def open_store(cfg: Any, output_dir: Path | str) -> WeightSink:
    """The store side of the transport `cfg` (a `weights` config section) for a run in `output_dir`."""
    if cfg.kind == FOLDER:
        return FolderStore(Path(output_dir) / "weights")
    raise ValueError(f"weights.kind: unknown transport {cfg.kind!r}")


def open_source(cfg: Any) -> WeightSource:
    """The source side of the transport `cfg` (a replica's `weights` config section)."""
    if cfg.kind == FOLDER:
        return FolderSource(full_verify=cfg.full_verify)
    raise ValueError(f"weights.kind: unknown transport {cfg.kind!r}")
