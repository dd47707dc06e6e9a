"""`gyre rl`: the three services as local child processes around an embedded Redis.

    gyre rl @ configs/reverse_text/demo.toml [--max-steps 5] [--ckpt] [--fresh]

What it does, in order: validate every config (all sections, the model source, loss and
environment names) before anything is created; lock the output folder (`locks/rl.lock`: a second
launch on it fails at once, naming the holder's pid); with ``--fresh`` delete the folder's previous
run; say so and exit 0 if the run is already finished; start Redis (persisting to
``{output_dir}/redis``); create the base model if the config asks for one; optionally run the SFT
warm-up; write one config per service to ``{output_dir}/configs/``; start ``inference`` (one or
more replicas), ``trainer`` and ``orchestrator`` with one log file each; watch the event logs for
the progress bar; and finish when trainer and orchestrator have both exited cleanly after
``max_steps``.

Resume: re-running the same command continues the run where it stands, however the previous launch
ended (Ctrl-C, a crash, SIGKILL of the whole tree). The trainer resumes after its last committed step
(published weights or checkpoint), the embedded Redis comes back with the stream from its
append-only file, and the orchestrator continues after the batches the trainer will still consume,
regenerating any that were lost (docs/local.md, "Re-runs, crashes and --fresh").

Failure policy: an inference process (a replica, a [[servers]] model) that exits mid-run is restarted with
backoff (`Restarts`, `inference_restarts` in a row), as its pod would be, and so is the embedded Redis, at once on
its port and append-only file (`_keep_redis`); any other child that exits while the
run is not finished (or exits non-zero) stops the run; the launcher names it, prints the end of its log and
exits 1. Ctrl-C/SIGTERM terminates every
child's process group and Redis before exiting. Children also get PDEATHSIG so a SIGKILLed
launcher leaves no orphans behind.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from gyre.config import ConfigError, load_config, parse_or_exit, to_toml
from gyre.config.loader import dump_toml, expand_shorthands, name_environment_variables, under_section
from gyre.config.rerun import SFT_RECORD, dotted_keys, sft_changes, sft_refusal
from gyre.config.rl import RLConfig
from gyre.config.trainer import SFTConfig
from gyre.events import ORCHESTRATOR_STEPS, SEGMENT_ENV, new_segment_id, read_events
from gyre.fsio import write_atomic
from gyre.inference_process import InferenceProcess, NotReady
from gyre.local.model_checks import check_against_the_model
from gyre.local.runs import (
    Run,
    ServiceConfigs,
    committed_steps,
    experiment_runs,
    refuse_changed_run_keys,
    resolve_configs,
    summarize,
    validate_extensions,
)
from gyre.proc import Child
from gyre.runlock import LockHeld, RunLock
from gyre.runstate import (
    RL_WARM_UP_ENV,
    SFT_CHECKPOINTS,
    committed_step,
    forget_rewinds,
    sft_checkpoints,
    sft_resume_problem,
)

log = logging.getLogger("gyre.local.launcher")

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
# What the launcher created the base model with (`model.init_preset`, `model.init_seed`), beside the services' configs.
MODEL_INIT_RECORD = "configs/model-init.toml"
ROLE_LOCK_WAIT_S = 60.0  # a previous launch's orchestrator finishes its current step on SIGTERM
RESTART_BACKOFF_S = 2.0  # before the first restart of a crashed inference process; doubled for each next one
RESTART_RESET_S = 300.0  # an inference process up this long has its restarts counted from 0 again
REDIS_RESTARTS = 3  # times one launch starts its embedded Redis again after it exited mid-run
STOP_TIMEOUT_S = 15.0  # SIGTERM to SIGKILL of a child that saves nothing when it stops (trainer, SFT: _stop_timeout)


_console_lock = threading.Lock()
_bar: Any = None


def _console(text: str) -> None:
    with _console_lock:
        if _bar is not None:
            _bar.write(text)
        else:
            print(text, flush=True)


class RunFailed(RuntimeError):
    pass


def _thread_env(share: float) -> dict[str, str]:
    """Split the CPU cores between the torch processes so they overlap instead of thrashing.

    Inference and trainer each get half of the cores (the orchestrator one): on a 2-core laptop
    that is one core each, which is what lets generation of batch s overlap training of step s-1.
    A user's own OMP_NUM_THREADS wins.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, int((os.cpu_count() or 2) * share)))}


def _gpu_env(devices: str | None) -> dict[str, str]:
    """Pin a service to GPUs (e.g. inference on GPU 0, trainer on 1-3); unset inherits the parent's."""
    return {} if devices is None else {"CUDA_VISIBLE_DEVICES": devices}


def _check_model(name: str, **how: str) -> None:
    """ModelUnavailable unless `name` is a model folder with its weights (one holding config.json alone passed
    here, and its inference replica failed only after Redis and the services had started) or a hub id that can
    be fetched now."""
    from gyre.model_source import check_model_source

    check_model_source(name, hub=False, **how)  # a folder's weights
    check_model_source(name, **how)  # a folder's config.json (a file is none), a hub id's fetch


def _gyre(*args: str) -> list[str]:
    return [sys.executable, "-m", "gyre.cli", *args]


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def _write_config(path: Path, config: Any) -> Path:
    # atomic: a launch killed mid-write left a truncated file that the re-run read (configs/sft.toml: the record its
    # changed-settings check compares with); 0600: it may hold the API key / control token
    return write_atomic(path, to_toml(config).encode(), mode=0o600)


def _sft_args(cfg: RLConfig) -> dict:
    """sft.args with `model = "x"` as {name = "x"}: the string replaced the model table the launcher gives the
    warm-up, and model.dtype was lost (the SFT ran at dtype auto), silently."""
    return expand_shorthands(SFTConfig, cfg.sft.args)


class Launcher:
    def __init__(self, cfg: RLConfig):
        self.cfg = cfg
        self.out = cfg.output_dir
        self.children: list[Child] = []
        self.redis = None
        self.redis_restarts = 0
        self.prometheus = None
        self.lock: RunLock | None = None
        self.trained = False  # whether this launch started the services (not: a run found already finished)
        # set by the first Ctrl-C/SIGTERM before its KeyboardInterrupt is raised: one raised inside a fork's at-fork
        # hook (logging's _releaseLock, while a child starts) is printed as "Exception ignored" and lost, and the
        # launch went on to train; every wait checks this too (`_check_interrupted`)
        self.interrupted = False

    # -- before anything is created -------------------------------------------------------------
    def model_name(self) -> str:
        """What the services load: the SFT result, else the base model (`{output_dir}/model` by default)."""
        if self.cfg.sft.enabled:
            return str(self.out / "sft")
        return self.cfg.model.name or str(self.out / "model")

    def validate(self) -> None:
        """Every config, the model source and extension names; raises ConfigError, creates nothing."""
        from gyre.config.loader import deep_merge
        from gyre.model_source import ModelUnavailable
        from gyre.wandb_log import WandbUnavailable, check_wandb

        cfg = self.cfg
        base = cfg.model.name or str(self.out / "model")
        if cfg.model.init_preset is not None:
            from gyre.model_init import PRESETS

            if cfg.model.init_preset not in PRESETS:
                raise ConfigError(
                    f"config key 'model.init_preset': unknown preset {cfg.model.init_preset!r} "
                    f"(use one of {', '.join(PRESETS)})"
                )
            name = cfg.model.name
            if name is not None and not Path(name).exists() and not _inside(Path(name), self.out):
                raise ConfigError(
                    f"config key 'model.init_preset': a random model is only created in a folder the run owns; "
                    f"model.name = {name!r} does not exist and is outside output_dir {self.out}: set model.name "
                    "to an existing model (or hub id) without init_preset, or unset model.name"
                )
        if cfg.sft.enabled:
            sft_values = {
                "run_id": cfg.run_id,
                "output_dir": str(self.out),
                "model": {"name": base, "dtype": cfg.model.dtype},
                "save_dir": str(self.out / "sft"),
            }
            try:
                sft = load_config(SFTConfig, [], **deep_merge(sft_values, _sft_args(cfg)))
            except ConfigError as e:
                raise under_section(e, "sft.args") from None
            if sft.data.env and not (self.out / "sft" / "config.json").exists():  # a typo there: now, not after Redis
                from gyre.envs import load_environment

                try:
                    load_environment(sft.data.env, **sft.data.env_args)
                except Exception as e:  # EnvironmentLoadError, or the environment's own argument checks
                    raise ConfigError(f"config key 'sft.args.data.env': {e}") from None
        self._refuse_ignored_settings(sft if cfg.sft.enabled else None)
        # the warm-up's own refusal came after Redis had started (the run failed: "sft failed with status 2")
        reused = (self.out / "sft" / "config.json").exists() and not cfg.fresh
        if cfg.sft.enabled and not reused:
            have = [] if cfg.fresh else sft_checkpoints(self.out)
            if problem := sft_resume_problem(sft.ckpt.resume_step, have, sft.max_steps, self.out / SFT_CHECKPOINTS):
                raise ConfigError(f"config key 'sft.args.{problem[0]}': {problem[1]}")
        configs = resolve_configs(cfg, self.model_name(), "redis://127.0.0.1:6379/0")
        validate_extensions(configs, cfg)
        refuse_changed_run_keys(cfg, configs)  # the trainer failed on them only after every service had started
        # the model source last of the keys: a hub id is fetched (offline: half a minute of the hub client's retries,
        # before a misspelt section key, found in a second, was said)
        if cfg.model.init_preset is None and not (cfg.sft.enabled and (self.out / "sft" / "config.json").exists()):
            try:
                _check_model(base)
            except ModelUnavailable as e:
                raise ConfigError(str(e)) from None
        for server in cfg.servers:
            try:
                # the server's own key, and no advice to set model.init_preset (the policy's alone)
                hint = "create one with `gyre model init --output-dir DIR` (or `gyre model import`) and use DIR"
                _check_model(server.model, key=f"servers.{server.name}.model", hint=hint)
            except ModelUnavailable as e:
                raise ConfigError(str(e)) from None
        check_against_the_model(cfg, configs, base, sft if cfg.sft.enabled else None)
        self._check_resume_step()
        try:  # the trainer crashed with wandb's traceback once every service had started
            check_wandb(cfg.wandb)
        except WandbUnavailable as e:
            raise ConfigError(f"config key 'wandb.enabled': {e}") from None
        if cfg.redis.url:
            self._check_redis(cfg.redis.url)
            self._check_streams_are_ours(cfg.redis.url)
        if cfg.fresh:
            self.check_fresh()  # again under the lock, in start_fresh; here before locks/ is created

    def _refuse_ignored_settings(self, sft: SFTConfig | None) -> None:
        """ConfigError naming the key when a re-run asks for a base model or SFT warm-up unlike the one the folder
        holds: neither is made again once it exists, so `--model.init-preset` / `--model.init-seed` or a changed
        `[sft.args]` were silently ignored and the run went on from the old one. A warm-up stopped half way (Ctrl-C)
        is resumed from its checkpoint, so the same holds for it but for how far it goes (`max_steps`, `epochs`): a
        changed base model or `[sft.args]` key was silently mixed into it (steps from one, steps from the other,
        recorded as the second), unless `sft.args.ckpt.resume_step = 0` trains it again from the base."""
        import tomllib

        if self.cfg.fresh:
            return  # nothing of the old run is kept

        def read(name: str) -> dict[str, Any] | None:
            try:
                return tomllib.loads((self.out / name).read_text())
            except (OSError, tomllib.TOMLDecodeError):
                return None

        again = "it is not made again in a run: use --fresh (starts the run over) or another --output-dir"
        base = Path(self.cfg.model.name or self.out / "model")
        made = read(MODEL_INIT_RECORD) if self.cfg.model.init_preset is not None and base.exists() else None
        if made is not None and Path(made.get("output_dir", "")).resolve() == base.resolve():
            for key, now in (("init_preset", self.cfg.model.init_preset), ("init_seed", self.cfg.model.init_seed)):
                if made.get(key) != now:
                    raise ConfigError(f"config key 'model.{key}': the base model {base} was created with "
                                      f"{key} = {made.get(key)!r}, not {now!r}; {again}")  # fmt: skip
        if sft is None:
            return
        finished = (self.out / "sft" / "config.json").exists()
        in_progress = not finished and sft.ckpt.resume_step != 0 and bool(sft_checkpoints(self.out))
        old = read(SFT_RECORD) if finished or in_progress else None
        if old is None:
            return
        new = tomllib.loads(to_toml(sft))
        what = f"the SFT warm-up in {self.out / 'sft'}"
        if in_progress:
            what = f"the SFT warm-up stopped half way (resumed from its checkpoint in {self.out / SFT_CHECKPOINTS})"
            again = ("it is resumed, not started again: use --sft.args.ckpt.resume-step 0 (the warm-up again from the "
                     "base model), --fresh (starts the run over) or another --output-dir")  # fmt: skip
        # a key one side lacks is compared only when this launch sets it: a key added to gyre sft since (with its
        # default) is no change the user made
        changes = sft_changes(old, new, dotted_keys(self.cfg.sft.args), in_progress)
        if changes:
            raise ConfigError(sft_refusal(changes, what, again, "sft.args."))

    @staticmethod
    def _check_redis(url: str) -> None:
        """An external Redis that cannot be reached fails here: the services would start and retry forever
        (what they must do in a cluster, where Redis may come up after them)."""
        from urllib.parse import urlsplit

        import redis

        client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
        try:
            client.ping()
        except (redis.RedisError, OSError) as e:
            where = urlsplit(url).netloc.rpartition("@")[2] or url  # no password in the message
            raise ConfigError(f"config key 'redis.url': cannot reach Redis at {where} ({e})") from None
        finally:
            client.close()

    def _check_streams_are_ours(self, url: str) -> None:
        """An external Redis may hold another experiment's batches under this run id (two experiments with the
        default run_id, or this folder deleted by hand): the orchestrator would count them as pushed and the
        trainer wait forever for batches its consumer group had read long ago. A run folder that never pushed
        a batch (no orchestrator step record, written before each push) owns no batch in the stream."""
        from gyre.events import ORCHESTRATOR_STEPS, events_dir
        from gyre.streams import BatchStream

        self._claim_run_ids(url, check_only=True)
        if self.cfg.fresh:
            return  # it deletes the stream's batches
        for run in experiment_runs(self.cfg):
            if (events_dir(run.output_dir) / ORCHESTRATOR_STEPS).exists():
                continue
            stream = BatchStream(url, run.name)
            try:
                count, newest = stream.length(), stream.latest_step()
            finally:
                stream.redis.close()
            if count:
                raise ConfigError(
                    f"config key 'redis.url': its stream {stream.key} holds {count} batches (up to step {newest}) "
                    f"that {run.output_dir} never pushed: another experiment uses run id {run.name!r} on this Redis. "
                    "Choose another run_id; if that experiment is gone, --fresh deletes its batches"
                )

    def _claim_run_ids(self, url: str, check_only: bool = False) -> None:
        """Record on an external Redis which run folder each run id of this experiment belongs to (`gyre:{run
        id}:owner`, host and folder), or with `check_only` just check it. Two experiments started side by side with
        one run_id (the default, a copied file) both found the stream empty and both pushed into it: each trainer
        trained the other's batches. ConfigError naming run_id when another folder holds one; `--fresh` takes it
        over (and deletes its batches, as it says)."""
        import socket

        import redis

        from gyre.streams import RunIdTaken, claim_run_id

        me = f"{socket.gethostname()}:{self.out.resolve()}"
        client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5, decode_responses=True)
        try:
            for index, run in enumerate(experiment_runs(self.cfg)):
                if self.cfg.fresh and check_only:
                    continue  # --fresh takes the id over at the launch
                try:
                    claim_run_id(client, run.name, me, check_only=check_only, take_over=self.cfg.fresh)
                except RunIdTaken as e:
                    name = f"runs.{index}.name" if self.cfg.runs else "run_id"
                    raise ConfigError(
                        f"config key '{name}': {name} {run.name!r} on the Redis of redis.url belongs to the run in "
                        f"{e.holder} (its stream gyre:{run.name}:batches): two experiments would train each other's "
                        f"batches. Choose another {name}; if that run is gone, --fresh takes the id over (deleting "
                        "its batches)"
                    ) from None
        finally:
            client.close()

    def _check_resume_step(self) -> None:
        """A rewind to a checkpoint that does not exist fails here, before the launch deletes the stream's
        newer batches and the orchestrator its newer progress for it (the trainer would fail only then)."""
        from gyre.runstate import orchestrator_progress, trainer_checkpoints

        for index, run in enumerate(experiment_runs(self.cfg)):
            # a [[runs]] entry's own rewind too: it failed in the trainer, after every service had started
            own = "resume_step" in run.trainer
            step = run.trainer["resume_step"] if own else self.cfg.ckpt.resume_step
            key = f"runs.{index}.trainer.resume_step" if own else "ckpt.resume_step"
            if step is None or step == 0:
                continue
            have = [] if self.cfg.fresh else trainer_checkpoints(run.output_dir)
            where = f"{run.output_dir}" + (" after --fresh" if self.cfg.fresh else "")
            if step == -1 and not have:
                raise ConfigError(f"config key '{key}': -1 needs a trainer checkpoint, {where} has none")
            if step > 0 and step not in have:
                raise ConfigError(
                    f"config key '{key}': no trainer checkpoint of step {step} in {where} "
                    f"(have {have or 'none'}; 0 rewinds to the base model)"
                )
            progress = orchestrator_progress(run.output_dir) or []
            if step > 0 and step not in progress:  # the orchestrator rewinds its task position from it
                raise ConfigError(
                    f"config key '{key}': no orchestrator progress checkpoint of step {step} in {where} "
                    f"(have {progress or 'none'}; trainer checkpoints {have})"
                )

    def acquire_locks(self) -> None:
        """`locks/rl.lock` at once (LockHeld names the holder); then wait for a previous launch's
        trainer and orchestrator, which finish their current step on SIGTERM, to let go of theirs."""
        self.lock = RunLock(self.out, "rl").acquire()
        if self.lock.took_over:
            _console(f"taking over the lock of pid {self.lock.took_over} (no longer running)")
        for role in ("trainer", "orchestrator", "sft"):  # sft: a previous launch's warm-up writes its result here
            try:
                RunLock(self.out, role).acquire(wait_s=0).release()
            except LockHeld as e:
                wait = max(ROLE_LOCK_WAIT_S, self._stop_timeout(role))
                _console(f"waiting up to {wait:.0f}s for pid {e.holder.get('pid')} ({role}) to exit")
                RunLock(self.out, role).acquire(wait_s=wait).release()

    def _stop_timeout(self, name: str) -> float:
        """How long a stop waits for child `name` before SIGKILL: trainer and SFT checkpoint their last step first
        (`ckpt.on_stop`), which takes the time of a checkpoint (`trainer_stop_timeout_s`); the others only finish what
        they are doing. The trainer had 15 s, and a larger model's stop checkpoint was cut."""
        if name in ("trainer", "sft"):
            return max(self.cfg.trainer_stop_timeout_s, STOP_TIMEOUT_S)
        return STOP_TIMEOUT_S

    def check_fresh(self) -> None:
        """Raise ConfigError unless `--fresh` may empty output_dir (a gyre run, or nothing but its entries)."""
        if not self.out.is_dir():
            return
        names = {p.name for p in self.out.iterdir()}
        foreign = sorted(name for name in names - set(RUN_ENTRIES) if not name.startswith(STAGING_PREFIX))
        if foreign and not any(any(self.out.glob(marker)) for marker in RUN_MARKERS):
            raise ConfigError(
                f"--fresh: {self.out} holds files gyre did not write ({', '.join(foreign[:5])}): "
                "refusing to delete them; remove them yourself or choose another --output-dir"
            )

    def start_fresh(self) -> None:
        """`--fresh`: delete what a previous run wrote here (and only that).

        Everything is first renamed into one staging folder (quick), then deleted (seconds for a model's weights):
        deleted in place, a Ctrl-C or crash half way left part of the old run (checkpoints without their events,
        weights without configs) for a plain re-run to resume, and leftovers that a later --fresh refused."""
        if not self.out.is_dir():
            return
        self.check_fresh()
        doomed = self.out / f"{STAGING_PREFIX}fresh-{uuid.uuid4().hex}"
        doomed.mkdir()
        for entry in list(self.out.iterdir()):
            if entry.name != "locks" and entry != doomed:  # locks: ours, held right now
                os.rename(entry, doomed / entry.name)
        shutil.rmtree(doomed)
        _console(f"--fresh: deleted the previous run in {self.out}")

    def remove_staging(self) -> None:
        """Delete the half-written base model and SFT result of a launch stopped while it created them (`gyre model
        init` and `gyre sft` stopped by SIGTERM left `.tmp-model-*` / `.tmp-sft-*`, up to a model's size each, and
        `--fresh` then refused the folder for them). Only under the run's lock, with no child of it running."""
        base = Path(self.cfg.model.name or self.out / "model")
        folders = [(self.out, "sft"), (self.out, "fresh")]  # fresh: what an interrupted --fresh had left to delete
        if self.cfg.model.init_preset is not None and _inside(base, self.out):
            folders.append((base.parent, base.name))
        for parent, name in folders:
            for staging in parent.glob(f"{STAGING_PREFIX}{name}-*") if parent.is_dir() else ():
                if staging.is_dir() and not staging.is_symlink():
                    shutil.rmtree(staging, ignore_errors=True)

    # -- set-up -------------------------------------------------------------------------------
    def _redis_url(self) -> str:
        if self.cfg.redis.url:
            return self.cfg.redis.url
        from gyre.redis_server import EmbeddedRedis

        # persistent: a re-run finds the batches pushed but not yet trained (and the trainer's group)
        self.redis = EmbeddedRedis(data_dir=self.out / "redis")
        self.redis.start()
        _console(f"embedded redis: {self.redis.url} (data in {self.redis.data_dir})")
        return self.redis.url

    def _keep_redis(self) -> None:
        """Start the embedded Redis again, on its port and append-only file, when it exited mid-run (the OOM killer,
        `kill -9`): the services retried it forever (backing off to 30 s) and the launcher waited for them, a hang
        that said nothing of why. Redis writes the file before it answers, so the stream, the consumer group and its
        pending entries come back and the run goes on as after a Redis pod's restart (docs/local.md). RunFailed,
        naming it and its log, when it cannot be started again or exits more than REDIS_RESTARTS times."""
        from gyre.redis_server import EmbeddedRedis, RedisServerError

        redis = self.redis
        if redis is None or redis.proc is None or (code := redis.proc.poll()) is None:
            return
        port, folder = redis.port, redis.data_dir
        redis.stop()
        self.redis, self.redis_restarts = None, self.redis_restarts + 1
        log = f"its log: {folder / 'redis.log'}"
        if self.redis_restarts > REDIS_RESTARTS:
            raise RunFailed(f"embedded redis was {_status(code)} again after {REDIS_RESTARTS} restarts; the run stops "
                            f"(the same command resumes it); {log}")  # fmt: skip
        _console(f"embedded redis was {_status(code)}; starting it again on port {port} from its append-only file in "
                 f"{folder} (restart {self.redis_restarts} of {REDIS_RESTARTS}; {log})")  # fmt: skip
        try:
            self.redis = EmbeddedRedis(port=port, data_dir=folder).start()
        except RedisServerError as e:
            raise RunFailed(
                f"embedded redis was {_status(code)} and could not be started again on port {port} "
                f"({e}); the run stops (the same command resumes it)"
            ) from None

    def _base_model(self) -> str:
        name = self.cfg.model.name or str(self.out / "model")
        if not Path(name).exists() and self.cfg.model.init_preset:
            _console(f"creating base model ({self.cfg.model.init_preset}) at {name}")
            self._run_once(
                "model-init",
                _gyre(
                    "model",
                    "init",
                    "--output-dir",
                    name,
                    "--preset",
                    self.cfg.model.init_preset,
                    "--seed",
                    str(self.cfg.model.init_seed),
                ),
            )
            record = {"init_preset": self.cfg.model.init_preset, "init_seed": self.cfg.model.init_seed,
                      "output_dir": str(Path(name).resolve())}  # fmt: skip
            write_atomic(self.out / MODEL_INIT_RECORD, dump_toml(record).encode())
        return name

    def _sft(self, base: str) -> str:
        sft_dir = self.out / "sft"
        if not self.cfg.sft.enabled:
            return base
        if (sft_dir / "config.json").exists():
            _console(f"SFT warm-up already done: {sft_dir}")
            return str(sft_dir)
        values = {
            "run_id": self.cfg.run_id,
            "output_dir": str(self.out),
            "model": {"name": base, "dtype": self.cfg.model.dtype},
            "save_dir": str(sft_dir),
            "log": self.cfg.log.model_dump(exclude_none=True),
        }
        from gyre.config.loader import deep_merge

        sft = load_config(SFTConfig, [], **deep_merge(values, _sft_args(self.cfg)))
        path = _write_config(self.out / SFT_RECORD, sft)
        _console(f"SFT warm-up: {sft.max_steps} steps -> {sft_dir}")
        # the run's own warm-up: `gyre sft` refuses another SFT in a gyre rl run's folder (gyre.runstate.rl_run_in)
        warm_up = {RL_WARM_UP_ENV: str(self.out.resolve())}
        child = self._run_once("sft", _gyre("sft", "@", str(path)), echo=True, env=warm_up)
        if not (sft_dir / "config.json").exists():  # a SIGTERM of its own: `gyre sft` checkpoints and exits 0
            raise RunFailed(f"sft stopped before it finished (no result in {sft_dir}); the same command resumes it; "
                            f"last lines of {child.log_path}:\n{child.tail()}")  # fmt: skip
        return str(sft_dir)

    def _check_interrupted(self) -> None:
        """KeyboardInterrupt when a stop was asked for whose own KeyboardInterrupt got lost (`interrupted`)."""
        if self.interrupted:
            raise KeyboardInterrupt

    def _run_once(self, name: str, argv: list[str], echo: bool = False, env: dict[str, str] | None = None) -> Child:
        import subprocess

        child = Child(name, argv, self.out / "logs" / f"{name}.log", console=_console)
        self.children.append(child)
        child.start(echo=echo or self.cfg.console == "all", env=env)
        while True:
            try:
                code = child.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                self._check_interrupted()
        self.children.remove(child)
        if code != 0:
            raise RunFailed(f"{name} failed with status {code}; last lines of {child.log_path}:\n{child.tail()}")
        return child

    # -- run ----------------------------------------------------------------------------------
    def run(self) -> int:
        self.validate()  # nothing exists yet: a bad config leaves no folder, server or process behind
        try:
            self.acquire_locks()  # creates {output_dir}/locks: the first thing written there
        except OSError as e:  # not a folder, not writable, on a read-only file system...
            where = e.filename or self.out
            raise ConfigError(
                f"config key 'output_dir': cannot use {self.out} as the run's folder: {where}: {e.strerror or e}"
            ) from None
        if self.cfg.fresh:
            self.start_fresh()
        self.remove_staging()
        runs, committed = experiment_runs(self.cfg), committed_steps(self.cfg)
        rewind = self.cfg.ckpt.resume_step is not None and self.cfg.ckpt.resume_step >= 0
        if not rewind and all(committed[run.name] >= run.max_steps for run in runs):
            where = "; ".join(f"{run.name}: step {committed[run.name]} of max_steps {run.max_steps}" for run in runs)
            _console(
                f"run already finished ({where}: trained and published) in {self.out} (--fresh starts over, "
                "a larger --max-steps continues it)"
            )
            return 0
        self.trained = True
        os.environ[SEGMENT_ENV] = new_segment_id()  # one run segment for every service of this launch
        redis_url = self._redis_url()
        if self.cfg.redis.url:  # under the lock; atomic: of two launches checked side by side, one gets the id
            self._claim_run_ids(redis_url)
        if self.cfg.fresh and self.cfg.redis.url:  # an embedded Redis started over with its folder; this one did not
            for run in runs:
                self._discard_stream_after(redis_url, run.name, 0, why="--fresh")
        elif rewind:
            for run in runs:
                self._discard_stream_after(redis_url, run.name, self.cfg.ckpt.resume_step)
                forget_rewinds(run.output_dir)  # this command asks for it: rewind also to a step rewound to before
        for run in runs:  # a run's own rewind ([[runs]] trainer.resume_step) is this command's request too
            if (own := run.trainer.get("resume_step")) is not None and own >= 0:
                forget_rewinds(run.output_dir)
        model = self._sft(self._base_model())
        configs = resolve_configs(self.cfg, model, redis_url)
        if self.cfg.prometheus:  # before the services: a short run's first steps must be scraped too
            self._start_prometheus(configs)
        cdir = self.out / "configs"
        echo = self.cfg.console == "all"
        replicas = []
        # the policy's replicas, then the [[servers]] (judges, reward models, teacher): inference processes alike
        named = [("inference" if len(configs.inference) == 1 else f"inference-{i}", inf)
                 for i, inf in enumerate(configs.inference)]  # fmt: skip
        named += [(f"server-{name}", inf) for name, inf in configs.servers.items()]
        for name, inf in named:
            config = _write_config(cdir / f"{name}.toml", inf)
            replicas.append(self._start_inference(name, config, _thread_env(0.5 / len(named))))
        trainer_cfg = _write_config(cdir / "trainer.toml", configs.trainer)
        argv = self.trainer_argv(trainer_cfg)
        trainer = Child("trainer", argv, self.out / "logs" / "trainer.log", console=_console)
        self.children.append(trainer)
        trainer.start(echo, env=_thread_env(0.5) | _gpu_env(self.cfg.trainer_gpus))
        # where to look while nothing moves: a large model loads for minutes before the first step's bar advances
        logs = [name for name, _ in named] + ["trainer"]
        logs += [f"orchestrator-{name}" for name in configs.orchestrators] if self.cfg.runs else ["orchestrator"]
        _console(f"logs: {self.out / 'logs'}/{{{','.join(logs)}}}.log" + ("" if echo else " (--console all prints "
                 "them here too)"))  # fmt: skip
        wait = self.cfg.inference_ready_timeout_s
        _console(f"waiting for inference to load {model} (up to {wait:g}s: inference_ready_timeout_s)")
        for child in replicas:
            deadline = time.monotonic() + wait
            while True:
                try:
                    child.wait_ready(timeout=1.0)
                    break
                except NotReady as e:
                    if child.poll() is not None:
                        raise RunFailed(str(e)) from None
                    if time.monotonic() >= deadline:
                        raise RunFailed(f"{child.name} not ready after {wait:g}s (raise inference_ready_timeout_s for "
                                        f"a model that loads longer); last lines of {child.log_path}:\n"
                                        f"{child.tail()}") from None  # fmt: skip
                self._check_interrupted()
                self._keep_redis()
        served = ", ".join(f"{child.base_url}" for child in replicas[: len(configs.inference)])
        policy = configs.inference[0]
        names = ", ".join(repr(run) for run in configs.orchestrators) if self.cfg.runs else repr(
            policy.served_model_name or policy.model.name)  # fmt: skip
        _console(f"inference: {served} (OpenAI API; model {names})")  # to curl or evaluate the policy as it trains
        orchestrators = []
        for run_name, orch in configs.orchestrators.items():
            name = f"orchestrator-{run_name}" if self.cfg.runs else "orchestrator"
            orch_cfg = _write_config(cdir / f"{name}.toml", orch)
            orchestrator = Child(
                name, _gyre("orchestrator", "@", str(orch_cfg)), self.out / "logs" / f"{name}.log", console=_console
            )
            self.children.append(orchestrator)
            orchestrator.start(echo, env=_thread_env(0))
            orchestrators.append(orchestrator)
        from gyre.local.progress import RunProgress

        global _bar
        start = {run.name: self._start_step(run, committed[run.name]) for run in runs}
        metrics = f"http://127.0.0.1:{configs.orchestrator.metrics.port}/metrics" if not self.cfg.runs else None
        progress = RunProgress(runs, start, segment=os.environ[SEGMENT_ENV], metrics_url=metrics)
        _bar = progress.bar
        restarts = Restarts(self.cfg.inference_restarts)
        by_name = {run.name: run for run in runs}
        run_of = {child.name: by_name[name] for child, name in zip(orchestrators, configs.orchestrators, strict=True)}
        try:
            while True:
                self._check_interrupted()
                self._keep_redis()
                progress.update()
                done = {c.name: c.poll() for c in (trainer, *orchestrators)}
                for child in list(self.children):
                    code = child.poll()
                    if code is None:
                        continue
                    if isinstance(child, InferenceProcess):  # stateless: restarted as its pod would be
                        if (again := restarts.due(child, code)) is not None:
                            self.children.remove(child)
                            self._start_inference(child.name, again, child.env)
                        continue
                    if code != 0:  # "status -9" said neither what killed it nor what to do next
                        raise RunFailed(f"{child.name} {_stopped(code)}; last lines of {child.log_path}:\n"
                                        f"{child.tail()}")  # fmt: skip
                    if (short := _unfinished(child, trainer, runs, run_of)) is not None:
                        # a service stopped on its own by a signal (`kill PID`) exits 0 as in a pod; waiting for
                        # the others then hung: the trainer waits for batches, the orchestrator for the trainer
                        raise RunFailed(f"{child.name} exited with status 0 before the run finished ({short}): was "
                                        "it sent SIGTERM or SIGINT? the same command resumes the run; last lines of "
                                        f"{child.log_path}:\n{child.tail()}")  # fmt: skip
                if all(code == 0 for code in done.values()):
                    progress.update()
                    break
                time.sleep(0.5)
        finally:
            progress.close()
            _bar = None
        return 0

    def _start_inference(self, name: str, config: Path, env: dict[str, str]) -> InferenceProcess:
        """Start one inference process (a policy replica or a [[servers]] model) from its config file."""
        child = InferenceProcess("@", str(config), log_path=self.out / "logs" / f"{name}.log", name=name,
                                 console=_console)  # fmt: skip
        child.config, child.env = config, env  # what a restart starts again
        # listed before it starts: a Ctrl-C between the two left a started child that shutdown() never stopped
        self.children.append(child)
        child.start(self.cfg.console == "all", env=env | _gpu_env(self.cfg.inference_gpus))
        return child

    def trainer_argv(self, config: Path) -> list[str]:
        """The trainer's command: `gyre trainer`, or torchrun of it with `trainer_nproc` processes."""
        if self.cfg.trainer_nproc == 1:
            return _gyre("trainer", "@", str(config))
        return [
            sys.executable,
            "-m",
            "gyre_trainer.torchrun",  # torchrun, exiting 0 (not 1 with a SignalException) after a clean stop
            "--standalone",
            f"--nproc-per-node={self.cfg.trainer_nproc}",
            # torchrun SIGKILLs its workers this long after forwarding a SIGTERM (30 s by default): the launcher's
            # own budget for the trainer's stop checkpoint, not less
            f"--shutdown-timeout={math.ceil(self._stop_timeout('trainer'))}",
            "-m",
            "gyre.cli",
            "trainer",
            "@",
            str(config),
        ]

    def _start_step(self, run: Run, committed: int) -> int:
        """Where `run` stands once its services start: the step it rewinds to (its own [[runs]] resume_step, else
        ckpt.resume_step), else its committed step."""
        rs = run.trainer.get("resume_step", self.cfg.ckpt.resume_step)
        return rs if rs is not None and rs >= 0 else committed

    def _discard_stream_after(self, redis_url: str, run_id: str, step: int, why: str = "") -> None:
        """A rewind (or `--fresh`) abandons the batches after `step`: delete them before the trainer can read one."""
        from gyre.streams import BatchStream

        stream = BatchStream(redis_url, run_id)
        try:
            dropped = stream.discard_after(step)
        finally:
            stream.redis.close()
        if dropped:
            _console(f"{why or f'rewind to step {step}'}: deleted the stream's batches of steps {sorted(dropped)}")

    def _start_prometheus(self, configs: ServiceConfigs) -> None:
        from gyre.local.prometheus import LocalPrometheus

        targets = {
            "inference": [f"127.0.0.1:{c.server.port}" for c in configs.inference],
            "trainer": [f"127.0.0.1:{configs.trainer.metrics.port}"],
            "orchestrator": [f"127.0.0.1:{c.metrics.port}" for c in configs.orchestrators.values()],
        }
        self.prometheus = LocalPrometheus(self.out / "prometheus", targets, run_id=self.cfg.run_id)
        self.prometheus.start()
        _console(f"prometheus: {self.prometheus.url}")

    def kill_services(self) -> None:
        """A second Ctrl-C while stopping: SIGKILL every service's process group now (what a crash does: the
        next launch resumes); shutdown() then finds them gone and stops Redis as usual."""
        for child in list(self.children):
            if child.proc is not None and child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, signal.SIGKILL)

    def shutdown(self) -> None:
        # Orchestrator first (stops issuing work), then trainer, then inference; Redis last.
        order = sorted(
            self.children,
            key=lambda c: 0 if c.name.startswith("orchestrator") else 1 if c.name == "trainer" else 2,
        )
        for child in order:
            child.stop(timeout=self._stop_timeout(child.name))
        self.children.clear()
        if self.prometheus is not None:
            self.prometheus.stop()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self.lock is not None:
            self.remove_staging()  # every child has exited: what one left half written is garbage
            self.lock.release()
            self.lock = None


def _status(code: int) -> str:
    """An exit status as a person reads it: `status 1`, or the signal that killed it (`SIGKILL`)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"status {code}"


def _unfinished(child: Child, trainer: Child, runs: list[Run], run_of: dict[str, Run]) -> str | None:
    """What `child`, a trainer or orchestrator that exited 0, left undone of its part of the run; None if nothing.

    Finished, the trainer has committed every run's `max_steps` and an orchestrator has pushed its run's last batch
    (it exits once the final weights are relayed, or after `final_weights_timeout_s`: the trainer may still be on it).
    """
    if child is trainer:
        short = [f"{run.name}: step {step} of {run.max_steps}" for run in runs
                 if (step := committed_step(run.output_dir)) < run.max_steps]  # fmt: skip
        return "; ".join(short) or None
    if (run := run_of.get(child.name)) is not None:  # an orchestrator (by its name): its run's
        # the newest record, not the highest step: after a rewind, older records of later steps remain
        pushed = next((r["step"] for r in reversed(read_events(run.output_dir / "events" / ORCHESTRATOR_STEPS))
                       if isinstance(r.get("step"), int)), 0)  # fmt: skip
        return None if pushed >= run.max_steps else f"{run.name}: batch {pushed} of {run.max_steps} pushed"
    return None


def _stopped(code: int) -> str:
    """How a service that stopped the run ended, and what to do next (the run resumes where it stands)."""
    if code >= 0:
        return f"exited with status {code}; once its cause is fixed, the same command resumes the run"
    oom = " (out of memory? the kernel's OOM killer sends it: dmesg)" if code == -signal.SIGKILL else ""
    return f"was {_status(code)}{oom}; the same command resumes the run"


class Restarts:
    """When a crashed inference process starts again: up to `limit` restarts in a row, each after a backoff that
    doubles (RESTART_BACKOFF_S, 2x, 4x...); one that ran RESTART_RESET_S since its last start has its count reset,
    as the kubelet does for a pod. Only inference processes are restarted: they hold nothing but the weights the
    orchestrator's relay brings a restarted replica back up to (its status probe sees it on the base version). The
    trainer and the orchestrator are not: after a crash the trainer resumes from the published weights with fresh
    optimizer state (a silent change a person decides on, by running the same command again), and both exit by
    themselves only on what a restart repeats (a setup refused, a bug, out of memory) - docs/local.md."""

    def __init__(self, limit: int):
        self.limit = limit
        self.count: dict[str, int] = {}
        self.started: dict[str, float] = {}  # when the process now running under a name was started
        self.at: dict[str, float] = {}  # when a crashed one starts again

    def due(self, child: InferenceProcess, code: int) -> Path | None:
        """The config to start `child` (exited with `code`) again from now; None while its backoff runs. Logs the
        crash in one line when it first sees it; RunFailed once it has been restarted `limit` times in a row."""
        name, now = child.name, time.monotonic()
        if name not in self.at:
            if now - self.started.get(name, now) >= RESTART_RESET_S:
                self.count[name] = 0
            n = self.count.get(name, 0) + 1
            if n > self.limit:
                after = f" after {self.limit} restarts" if self.limit else ""
                raise RunFailed(
                    f"{name} {'exited with' if code >= 0 else 'was'} {_status(code)}{after} (inference_restarts = "
                    f"{self.limit}); the run stops (the same command resumes it); last lines of {child.log_path}:\n"
                    f"{child.tail()}"
                )
            self.count[name], delay = n, RESTART_BACKOFF_S * 2 ** (n - 1)
            self.at[name] = now + delay
            _console(f"{name} {'exited with' if code >= 0 else 'was'} {_status(code)}; restarting it in {delay:.0f}s "
                     f"(restart {n} of {self.limit}, inference_restarts; its log: {child.log_path})")  # fmt: skip
        if now < self.at[name]:
            return None
        del self.at[name]
        self.started[name] = now
        return child.config


def _consume_rl_environment() -> None:
    """Drop the `GYRE_A__B` variables that were `gyre rl`'s own keys once its config is read: their values
    reach every service through the config the launcher writes for it, and a service reading them again
    as its own keys misreads them (`GYRE_ORCHESTRATOR__ENV__NAME` is the trainer's `orchestrator` table,
    `GYRE_INFERENCE__...` the orchestrator's `inference`, `GYRE_CKPT__ENABLED` a key no service has)."""
    for name in list(os.environ):
        key = name.upper().removeprefix("GYRE_")
        if key != name.upper() and key.split("__")[0].lower() in RLConfig.model_fields:
            del os.environ[name]


def main(argv: list[str] | None = None) -> int:
    cfg = parse_or_exit(RLConfig, argv, "gyre rl")  # a misspelt GYRE_ variable too (RLConfig.check_environment)
    environ = dict(os.environ)  # as the user set it: an error names the variable that set its key
    _consume_rl_environment()  # before the services' configs are validated and their processes started
    from gyre.logging import setup_logging

    # not log.file: the services append to it; the launcher writes nothing before the config is checked
    setup_logging(cfg.log.level, None, "launcher")  # text whatever log.format: these lines are for the terminal
    launcher = Launcher(cfg)
    stopping: list[float] = []  # when the launcher began to stop (an interrupt, a failure, the end)

    def _on_signal(signum, _frame):
        if not stopping:
            stopping.append(time.monotonic())
            launcher.interrupted = True
            raise KeyboardInterrupt
        # Once stopping, a signal must not abort the shutdown half way (a traceback, services left to PDEATHSIG):
        # a second Ctrl-C kills the services now. Within a second it is the first one delivered twice (to the
        # launcher and to its process group, as `timeout -s INT` does), which lets them finish their step.
        if time.monotonic() - stopping[0] > 1.0:
            _console("gyre rl: killing the services now (the next launch resumes the run)")
            launcher.kill_services()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    started = time.monotonic()
    try:
        code = launcher.run()
    except ConfigError as e:  # a service's key set by GYRE_TRAINER__...: its error names the variable too
        print(f"gyre rl: error: {name_environment_variables(str(e), environ)}", file=sys.stderr)
        code = 2
    except LockHeld as e:
        print(f"gyre rl: error: {e}", file=sys.stderr)
        code = 2
    except RunFailed as e:
        print(f"gyre rl: run failed: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        # during the warm-up it is the SFT that checkpoints (the message said the trainer, which had not started);
        # before either (Redis, the base model's creation) nothing is trained: the message promised a checkpoint
        running = {child.name for child in launcher.children}
        who = "the SFT warm-up" if "sft" in running else "the trainer" if "trainer" in running else None
        if who is None:
            print("gyre rl: interrupted before training started, stopping; the same command starts again",
                  file=sys.stderr)  # fmt: skip
        else:
            print(f"gyre rl: interrupted, stopping services; {who} checkpoints its last step first (up to "
                  f"{cfg.trainer_stop_timeout_s:.0f}s, trainer_stop_timeout_s); Ctrl-C again kills them at once",
                  file=sys.stderr)  # fmt: skip
        code = 130
    finally:
        stopping[:] = stopping or [time.monotonic()]
        launcher.shutdown()
    # every service has stopped: a Ctrl-C now (the summary draws report.png, seconds) only ends the summary; it was
    # answered "killing the services now (the next launch resumes the run)" and ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if code == 0:  # the wall time of this launch's training: none when it found the run finished (was "0.0 min")
        try:
            print(summarize(cfg, wall_seconds=time.monotonic() - started if launcher.trained else None))
        except KeyboardInterrupt:
            print(f"gyre rl: interrupted while writing the summary (the run is done); `gyre report {cfg.output_dir}` "
                  "draws it", file=sys.stderr)  # fmt: skip
            return 130
    return code
