"""Optional Weights & Biases logging: each service's step metrics, eval results and a table of samples.

    [wandb]               # in a `gyre rl` file (top level: every service gets it) or any service's config
    enabled = true
    project = "gyre"
    mode = "offline"      # or "online"; unset = wandb's default / the WANDB_MODE environment variable

One wandb run per service process, grouped by `run_id` (`<run_id>-orchestrator`, `<run_id>-trainer`), written
under `{output_dir}/wandb`. The orchestrator logs `orchestrator/*` per step, `eval/*` per evaluation, and a
`samples` table (prompt, completion, answer, reward, advantage, versions) at every rollout dump; the trainer logs
`trainer/*`. A launch of the same run folder again (`gyre rl` resuming it, a restarted pod) continues the same W&B
run: its id is kept in `{output_dir}/wandb/<service>.id` and passed with `resume="allow"` (`--fresh`, which deletes
the run's `wandb/`, starts a new one). Needs the `wandb` extra (`pip install 'gyre[wandb]'`); disabled (the
default), nothing is imported. Online, W&B needs an API key (`wandb login`, WANDB_API_KEY): `check_wandb` says so
before a service starts (`gyre rl` before anything starts, where an interactive `wandb login` prompt may ask for it),
as each service does when it opens its run; a trainer crashed with wandb's traceback after the run had started.
"""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from gyre.rollouts import DETAILS, details_line, message_text

log = logging.getLogger(__name__)
SAMPLE_COLUMNS = ["step", "task_id", "prompt", "completion", "answer", "reward", "advantage", "min_version",
                  "max_version", "stop_reason", "details"]  # fmt: skip


def run_identity(output_dir: Path, service: str) -> str:
    """The W&B run id of this service in this run folder: the one kept there, else a new one, kept for the launches to
    come (each launch opened a new W&B run under the same name, so a resumed run's curves were split across runs)."""
    import secrets

    from gyre.fsio import write_atomic

    path = Path(output_dir) / "wandb" / f"{service}.id"
    try:
        kept = path.read_text().strip()
    except FileNotFoundError:
        kept = ""
    if re.fullmatch(r"[a-z0-9]{8,64}", kept):
        return kept
    if kept:  # never a W&B run of another: a file damaged by hand gets a new run, and the log says so
        log.warning("W&B run id in %s is not one (%r): starting a new W&B run", path, kept[:80])
    identity = secrets.token_hex(8)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, identity.encode())
    return identity


#: WANDB_MODE values that log nothing online (no API key needed)
OFFLINE_MODES = ("offline", "dryrun", "disabled")


class WandbUnavailable(ValueError):
    """wandb.enabled, but no W&B run can start: the package is missing, or online and no API key is configured."""


def _import_wandb():
    try:
        import wandb
    except ImportError:
        raise WandbUnavailable("wandb.enabled = true needs the wandb package: pip install 'gyre[wandb]'") from None
    return wandb


def _no_key(error: Exception) -> WandbUnavailable:
    return WandbUnavailable(
        f"wandb.enabled = true logs online and W&B has no API key here ({error}): run `wandb login` or set "
        "WANDB_API_KEY, or set wandb.mode = 'offline' (then `wandb sync` the run's wandb/ folder)"
    )


def check_wandb(cfg) -> None:
    """WandbUnavailable naming what to do when `cfg.enabled` but a W&B run could not start: the package missing,
    or online (`cfg.mode`, else WANDB_MODE, else online) with no API key (WANDB_API_KEY, `wandb login`'s netrc).
    `wandb.login` reads the key as `wandb.init` does; on a terminal it asks for one, as wandb does."""
    if not cfg.enabled:
        return
    wandb = _import_wandb()
    if (cfg.mode or os.environ.get("WANDB_MODE") or "online") in OFFLINE_MODES or os.environ.get("WANDB_API_KEY"):
        return
    try:
        wandb.login(verify=False)
    except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as e:
        raise _no_key(e) from None


class WandbLogger:
    """No-op unless `cfg.enabled`; then a wandb run for this service (see the module docstring)."""

    def __init__(self, cfg, *, service: str, run_id: str, output_dir: Path | str, config: BaseModel | dict[str, Any]):
        """`config`: the service's config, shown as the W&B run's config with its secrets masked (an API key or
        control token in clear went to W&B's servers, readable by everyone on the project)."""
        self.service, self.cfg, self.run = service, cfg, None
        if not cfg.enabled:
            return
        self._wandb = wandb = _import_wandb()
        folder = Path(output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                id=run_identity(folder, service),
                resume="allow",  # the id's run continued when W&B has it, created when not (the first launch)
                project=cfg.project,
                entity=cfg.entity,
                group=cfg.group or run_id,
                name=f"{run_id}-{service}",
                job_type=service,
                mode=cfg.mode,
                dir=str(folder),
                config=config.model_dump(mode="json") if isinstance(config, BaseModel) else config,  # secrets masked
                reinit="create_new",
            )
        except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as e:  # no API key (not a crash)
            raise _no_key(e) from None
        # Each kind of record has its own x axis (eval versions lag training steps; wandb's own step must grow).
        for prefix in (service, "eval"):
            self.run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/step")
        self.run.define_metric("samples", step_metric=f"{service}/step")

    def log(self, record: dict[str, Any], prefix: str | None = None) -> None:
        """The numeric fields of an event record (which has a `step`) as `<prefix>/<key>`."""
        if self.run is None:
            return
        prefix = prefix or self.service
        values = {f"{prefix}/{k}": float(v) for k, v in record.items()
                  if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}  # fmt: skip
        self.run.log(values)

    def samples(self, records: list[dict[str, Any]], step: int) -> None:
        """The first `cfg.samples` rollout-dump records as a `samples` table."""
        if self.run is None or not records:
            return
        rows = [[r["step"], r["task_id"], message_text(r["prompt"], "user"), message_text(r["completion"]),
                 r.get("answer", ""), r["reward"], r["advantage"], r["min_version"], r["max_version"],
                 r["stop_reason"], details_line(r.get(DETAILS))] for r in records[: self.cfg.samples]]  # fmt: skip
        table = self._wandb.Table(columns=SAMPLE_COLUMNS, data=rows)
        self.run.log({"samples": table, f"{self.service}/step": step})

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
