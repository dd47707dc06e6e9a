"""How a model folder is written (`gyre model init`, `gyre model import`): complete or not at all, and never over
something that is not a model.

A folder is written under a fresh `.tmp-*` name beside its destination (`staging_path`), every file fsynced, then
swapped in (`publish_model_folder`); SIGTERM interrupts the writing as Ctrl-C does (`sigterm_as_interrupt`), so the
writer's clean-up removes the staging folder. `check_output_dir` refuses a destination that holds anything but a
model, or the model of a running run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import uuid
from pathlib import Path

from gyre.fsio import fsync_dir, fsync_files
from gyre.runlock import running_holder


def make_tokenizer_config_portable(path: Path) -> None:
    """Rewrite transformers-5-only keys to the names both transformers 4.56+ and 5 read.

    vLLM images may pin a transformers 4.x, which knows neither the `TokenizersBackend` class nor a list
    under `extra_special_tokens`; transformers 5 maps `PreTrainedTokenizerFast` and
    `additional_special_tokens` back to its own names, so the loaded tokenizer is the same.
    """
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(config.get("extra_special_tokens"), list):
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def staging_path(output_dir: Path) -> Path:
    """A fresh `.tmp-*` name beside `output_dir`, chosen before the folder is made: the caller makes it inside its
    cleanup's try, so a Ctrl-C or SIGTERM at any instant leaves no folder behind (with mkdtemp one arriving between
    the folder's creation and the assignment left it, unnamed, for good)."""
    return output_dir.parent / f".tmp-{output_dir.name}-{uuid.uuid4().hex[:8]}"


def check_output_dir(output_dir: Path, overwrite: bool, how: str = "pass --overwrite to replace it") -> None:
    """FileExistsError unless a model may be written to `output_dir`: absent, empty, or (with `overwrite`) a model
    folder. `--overwrite` replaces the whole folder: on a run folder (`--output-dir outputs/demo`) or a project
    (`--output-dir .`) it deleted every checkpoint, or every file, there."""
    if output_dir.exists() and not output_dir.is_dir():
        raise FileExistsError(f"{output_dir} is a file, not a folder: choose another --output-dir")
    if not (output_dir.is_dir() and any(output_dir.iterdir())):
        return
    if not overwrite:
        raise FileExistsError(f"{output_dir} already exists and is not empty; {how}")
    if not (output_dir / "config.json").is_file():
        raise FileExistsError(
            f"{output_dir} is not a model folder (no config.json): --overwrite replaces only a model folder; "
            "choose another --output-dir, or empty it yourself"
        )
    # a run's base model (`{run}/model`, gyre rl's default) replaced under its live services: replicas restarting
    # and the trainer's next resume would load a different model than the one the run started from
    for role in ("rl", "trainer", "orchestrator", "sft"):
        holder = running_holder(output_dir.parent, role)
        if holder is not None:
            raise FileExistsError(
                f"{output_dir} is the model of a running run: pid {holder.get('pid')} ({role}, "
                f"{holder.get('command', 'unknown command')}) uses {output_dir.parent}; stop it first, "
                "or choose another --output-dir"
            )


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM raises KeyboardInterrupt inside the block, as Ctrl-C does, so the clean-up of a half-written folder runs
    (`.tmp-*` staging, removed by `except BaseException`): its default action ended the process on the spot and left
    the folder, up to a model's size (only `gyre rl` removed them, from its own run folder). The `gyre` command prints
    one line for it and exits 130. Main thread only (elsewhere a no-op: signal handlers belong to the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def publish_model_folder(staging: Path, output_dir: Path) -> None:
    """fsync every file, then swap `staging` in as `output_dir` (an old folder is removed only afterwards)."""
    files = list(staging.iterdir())
    for file in files:
        file.chmod(0o644)  # save_pretrained may leave 0600; other services' users read these
    fsync_files(files)
    staging.chmod(0o755)  # staging is made 0700
    retired = None
    if output_dir.exists():
        retired = output_dir.with_name(f".old-{output_dir.name}-{os.getpid()}")
        output_dir.rename(retired)
    staging.rename(output_dir)
    fsync_dir(output_dir.parent)
    if retired is not None:
        shutil.rmtree(retired)
