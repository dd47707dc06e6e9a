"""What `gyre rl` may delete in a run's output folder: `--fresh` empties a folder only when it is a gyre run, and a
launch removes what a stopped child left half written there."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from gyre.config import ConfigError
from gyre.config.rl import RLConfig
from gyre.local.progress import console

# What a run writes into its output folder. `--fresh` empties a folder that is a gyre run (holds one
# of RUN_MARKERS) or holds nothing but RUN_ENTRIES, and refuses any other: a mistyped --output-dir
# must never cost the user their files. The markers are files only a launch writes: a folder name alone
# (a project's own `configs/`) once made `--fresh --output-dir .` delete the whole project.
RUN_ENTRIES = (
    "model", "sft", "weights", "checkpoints", "events", "batches", "configs", "logs", "redis",
    "prometheus", "report.png", "locks", "runs", "rollouts", "samples.md", "debug", "wandb",
)  # fmt: skip
RUN_MARKERS = ("configs/trainer.toml", "configs/sft.toml", "events/*.jsonl")
# What gyre writes a folder under before renaming it into view (gyre.fsio, `gyre model init`, `gyre sft`'s result):
# a child stopped while writing one (Ctrl-C during start-up) leaves it behind.
STAGING_PREFIX = ".tmp-"


def inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def check_fresh(out: Path) -> None:
    """Raise ConfigError unless `--fresh` may empty `out` (a gyre run, or nothing but its entries)."""
    if not out.is_dir():
        return
    names = {p.name for p in out.iterdir()}
    foreign = sorted(name for name in names - set(RUN_ENTRIES) if not name.startswith(STAGING_PREFIX))
    if foreign and not any(any(out.glob(marker)) for marker in RUN_MARKERS):
        raise ConfigError(
            f"--fresh: {out} holds files gyre did not write ({', '.join(foreign[:5])}): "
            "refusing to delete them; remove them yourself or choose another --output-dir"
        )


def start_fresh(out: Path) -> None:
    """`--fresh`: delete what a previous run wrote in `out` (and only that), under the run's lock.

    Everything is first renamed into one staging folder (quick), then deleted (seconds for a model's weights):
    deleted in place, a Ctrl-C or crash half way left part of the old run (checkpoints without their events,
    weights without configs) for a plain re-run to resume, and leftovers that a later --fresh refused."""
    if not out.is_dir():
        return
    check_fresh(out)
    previous = [entry for entry in out.iterdir() if entry.name != "locks"]  # locks: ours, held right now
    if not previous:  # a first launch (the folder holds only the lock just taken): nothing to delete or to say
        return
    doomed = out / f"{STAGING_PREFIX}fresh-{uuid.uuid4().hex}"
    doomed.mkdir()
    for entry in previous:
        os.rename(entry, doomed / entry.name)
    shutil.rmtree(doomed)
    console(f"--fresh: deleted the previous run in {out}")


def remove_staging(cfg: RLConfig) -> None:
    """Delete the half-written base model and SFT result of a launch stopped while it created them (`gyre model
    init` and `gyre sft` stopped by SIGTERM left `.tmp-model-*` / `.tmp-sft-*`, up to a model's size each, and
    `--fresh` then refused the folder for them). Only under the run's lock, with no child of it running."""
    out = cfg.output_dir
    base = Path(cfg.model.name or out / "model")
    folders = [(out, "sft"), (out, "fresh")]  # fresh: what an interrupted --fresh had left to delete
    if cfg.model.init_preset is not None and inside(base, out):
        folders.append((base.parent, base.name))
    for parent, name in folders:
        for staging in parent.glob(f"{STAGING_PREFIX}{name}-*") if parent.is_dir() else ():
            if staging.is_dir() and not staging.is_symlink():
                shutil.rmtree(staging, ignore_errors=True)
