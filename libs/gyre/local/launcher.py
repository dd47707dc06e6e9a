"""`gyre rl`: the three services as local child processes around an embedded Redis.

    gyre rl @ configs/reverse_text/demo.toml [--max-steps 5] [--ckpt] [--fresh]

What it does, in order: validate every config (all sections, the model source, loss and environment names:
`gyre.local.preflight`) before anything is created; lock the output folder (`locks/rl.lock`: a second launch on it
fails at once, naming the holder's pid); with ``--fresh`` delete the folder's previous run (`gyre.local.output_folder`:
only a folder that is a gyre run); say so and exit 0 if the run is already finished; start Redis (persisting to
``{output_dir}/redis``); create the base model if the config asks for one; optionally run the SFT warm-up; write one
config per service to ``{output_dir}/configs/``; start ``inference`` (one or more replicas), ``trainer`` and
``orchestrator`` with one log file each; watch the event logs for the progress bar; and finish when trainer and
orchestrator have both exited cleanly after ``max_steps``.

Resume: re-running the same command continues the run where it stands, however the previous launch
ended (Ctrl-C, a crash, SIGKILL of the whole tree). The trainer resumes after its last committed step
(published weights or checkpoint), the embedded Redis comes back with the stream from its
append-only file, and the orchestrator continues after the batches the trainer will still consume,
regenerating any that were lost (docs/local.md, "Re-runs, crashes and --fresh").

Failure policy (`gyre.local.supervision`): an inference process (a replica, a [[servers]] model) that exits mid-run
is restarted with backoff (`Restarts`, `inference_restarts` in a row), as its pod would be, and so is the embedded
Redis, at once on its port and append-only file (`_keep_redis`); any other child that exits while the run is not
finished (or exits non-zero) stops the run; the launcher names it, prints the end of its log and exits 1.
Ctrl-C/SIGTERM terminates every child's process group and Redis before exiting. Children also get PDEATHSIG so a
SIGKILLed launcher leaves no orphans behind.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from gyre.config import ConfigError, load_config, parse_or_exit, to_toml
from gyre.config.mistakes import name_environment_variables
from gyre.config.rerun import SFT_RECORD
from gyre.config.rl import RLConfig
from gyre.config.toml_io import dump_toml
from gyre.config.trainer import SFTConfig
from gyre.events import SEGMENT_ENV, new_segment_id
from gyre.fsio import write_atomic
from gyre.inference_process import InferenceProcess, NotReady
from gyre.local.output_folder import remove_staging, start_fresh
from gyre.local.preflight import MODEL_INIT_RECORD, claim_run_ids, sft_args, validate
from gyre.local.progress import RunProgress, console
from gyre.local.runs import Run, ServiceConfigs, committed_steps, experiment_runs, resolve_configs, summarize
from gyre.local.supervision import Restarts, RunFailed, exit_status, how_it_stopped, unfinished
from gyre.proc import Child
from gyre.runlock import LockHeld, RunLock
from gyre.runstate import RL_WARM_UP_ENV, forget_rewinds

log = logging.getLogger("gyre.local.launcher")

ROLE_LOCK_WAIT_S = 60.0  # a previous launch's orchestrator finishes its current step on SIGTERM
REDIS_RESTARTS = 3  # times one launch starts its embedded Redis again after it exited mid-run
STOP_TIMEOUT_S = 15.0  # SIGTERM to SIGKILL of a child that saves nothing when it stops (trainer, SFT: _stop_timeout)


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


def _gyre(*args: str) -> list[str]:
    return [sys.executable, "-m", "gyre.cli", *args]


def _write_config(path: Path, config: Any) -> Path:
    # atomic: a launch killed mid-write left a truncated file that the re-run read (configs/sft.toml: the record its
    # changed-settings check compares with); 0600: it may hold the API key / control token
    return write_atomic(path, to_toml(config).encode(), mode=0o600)


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
    def validate(self) -> None:
        """Every check before anything is created (`gyre.local.preflight`); raises ConfigError."""
        validate(self.cfg)

    def acquire_locks(self) -> None:
        """`locks/rl.lock` at once (LockHeld names the holder); then wait for a previous launch's
        trainer and orchestrator, which finish their current step on SIGTERM, to let go of theirs."""
        self.lock = RunLock(self.out, "rl").acquire()
        if self.lock.took_over:
            console(f"taking over the lock of pid {self.lock.took_over} (no longer running)")
        for role in ("trainer", "orchestrator", "sft"):  # sft: a previous launch's warm-up writes its result here
            try:
                RunLock(self.out, role).acquire(wait_s=0).release()
            except LockHeld as e:
                wait = max(ROLE_LOCK_WAIT_S, self._stop_timeout(role))
                console(f"waiting up to {wait:.0f}s for pid {e.holder.get('pid')} ({role}) to exit")
                RunLock(self.out, role).acquire(wait_s=wait).release()

    def _stop_timeout(self, name: str) -> float:
        """How long a stop waits for child `name` before SIGKILL: trainer and SFT checkpoint their last step first
        (`ckpt.on_stop`), which takes the time of a checkpoint (`trainer_stop_timeout_s`); the others only finish what
        they are doing. The trainer had 15 s, and a larger model's stop checkpoint was cut."""
        if name in ("trainer", "sft"):
            return max(self.cfg.trainer_stop_timeout_s, STOP_TIMEOUT_S)
        return STOP_TIMEOUT_S

    # -- set-up -------------------------------------------------------------------------------
    def _redis_url(self) -> str:
        if self.cfg.redis.url:
            return self.cfg.redis.url
        from gyre.redis_server import EmbeddedRedis

        # persistent: a re-run finds the batches pushed but not yet trained (and the trainer's group)
        self.redis = EmbeddedRedis(data_dir=self.out / "redis")
        self.redis.start()
        console(f"embedded redis: {self.redis.url} (data in {self.redis.data_dir})")
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
            raise RunFailed(f"embedded redis was {exit_status(code)} again after {REDIS_RESTARTS} restarts; the run "
                            f"stops (the same command resumes it); {log}")  # fmt: skip
        console(f"embedded redis was {exit_status(code)}; starting it again on port {port} from its append-only file "
                f"in {folder} (restart {self.redis_restarts} of {REDIS_RESTARTS}; {log})")  # fmt: skip
        try:
            self.redis = EmbeddedRedis(port=port, data_dir=folder).start()
        except RedisServerError as e:
            raise RunFailed(
                f"embedded redis was {exit_status(code)} and could not be started again on port {port} "
                f"({e}); the run stops (the same command resumes it)"
            ) from None

    def _base_model(self) -> str:
        name = self.cfg.model.name or str(self.out / "model")
        if not Path(name).exists() and self.cfg.model.init_preset:
            console(f"creating base model ({self.cfg.model.init_preset}) at {name}")
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
            console(f"SFT warm-up already done: {sft_dir}")
            return str(sft_dir)
        values = {
            "run_id": self.cfg.run_id,
            "output_dir": str(self.out),
            "model": {"name": base, "dtype": self.cfg.model.dtype},
            "save_dir": str(sft_dir),
            "log": self.cfg.log.model_dump(exclude_none=True),
        }
        from gyre.config.loader import deep_merge

        sft = load_config(SFTConfig, [], **deep_merge(values, sft_args(self.cfg)))
        path = _write_config(self.out / SFT_RECORD, sft)
        console(f"SFT warm-up: {sft.max_steps} steps -> {sft_dir}")
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

        child = Child(name, argv, self.out / "logs" / f"{name}.log", console=console)
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
            start_fresh(self.out)
        remove_staging(self.cfg)
        runs, committed = experiment_runs(self.cfg), committed_steps(self.cfg)
        rewind = self.cfg.ckpt.resume_step is not None and self.cfg.ckpt.resume_step >= 0
        if not rewind and all(committed[run.name] >= run.max_steps for run in runs):
            where = "; ".join(f"{run.name}: step {committed[run.name]} of max_steps {run.max_steps}" for run in runs)
            console(
                f"run already finished ({where}: trained and published) in {self.out} (--fresh starts over, "
                "a larger --max-steps continues it)"
            )
            return 0
        self.trained = True
        os.environ[SEGMENT_ENV] = new_segment_id()  # one run segment for every service of this launch
        redis_url = self._redis_url()
        if self.cfg.redis.url:  # under the lock; atomic: of two launches checked side by side, one gets the id
            claim_run_ids(self.cfg, redis_url)
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
        trainer = Child("trainer", argv, self.out / "logs" / "trainer.log", console=console)
        self.children.append(trainer)
        trainer.start(echo, env=_thread_env(0.5) | _gpu_env(self.cfg.trainer_gpus))
        # where to look while nothing moves: a large model loads for minutes before the first step's bar advances
        logs = [name for name, _ in named] + ["trainer"]
        logs += [f"orchestrator-{name}" for name in configs.orchestrators] if self.cfg.runs else ["orchestrator"]
        console(f"logs: {self.out / 'logs'}/{{{','.join(logs)}}}.log" + ("" if echo else " (--console all prints "
                "them here too)"))  # fmt: skip
        wait = self.cfg.inference_ready_timeout_s
        console(f"waiting for inference to load {model} (up to {wait:g}s: inference_ready_timeout_s)")
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
        console(f"inference: {served} (OpenAI API; model {names})")  # to curl or evaluate the policy as it trains
        orchestrators = []
        for run_name, orch in configs.orchestrators.items():
            name = f"orchestrator-{run_name}" if self.cfg.runs else "orchestrator"
            orch_cfg = _write_config(cdir / f"{name}.toml", orch)
            orchestrator = Child(
                name, _gyre("orchestrator", "@", str(orch_cfg)), self.out / "logs" / f"{name}.log", console=console
            )
            self.children.append(orchestrator)
            orchestrator.start(echo, env=_thread_env(0))
            orchestrators.append(orchestrator)
        start = {run.name: self._start_step(run, committed[run.name]) for run in runs}
        metrics = f"http://127.0.0.1:{configs.orchestrator.metrics.port}/metrics" if not self.cfg.runs else None
        progress = RunProgress(runs, start, segment=os.environ[SEGMENT_ENV], metrics_url=metrics)
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
                        raise RunFailed(f"{child.name} {how_it_stopped(code)}; last lines of {child.log_path}:\n"
                                        f"{child.tail()}")  # fmt: skip
                    if (short := unfinished(child, trainer, runs, run_of)) is not None:
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
        return 0

    def _start_inference(self, name: str, config: Path, env: dict[str, str]) -> InferenceProcess:
        """Start one inference process (a policy replica or a [[servers]] model) from its config file."""
        child = InferenceProcess("@", str(config), log_path=self.out / "logs" / f"{name}.log", name=name,
                                 console=console)  # fmt: skip
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
            console(f"{why or f'rewind to step {step}'}: deleted the stream's batches of steps {sorted(dropped)}")

    def _start_prometheus(self, configs: ServiceConfigs) -> None:
        from gyre.local.prometheus import LocalPrometheus

        targets = {
            "inference": [f"127.0.0.1:{c.server.port}" for c in configs.inference],
            "trainer": [f"127.0.0.1:{configs.trainer.metrics.port}"],
            "orchestrator": [f"127.0.0.1:{c.metrics.port}" for c in configs.orchestrators.values()],
        }
        self.prometheus = LocalPrometheus(self.out / "prometheus", targets, run_id=self.cfg.run_id)
        self.prometheus.start()
        console(f"prometheus: {self.prometheus.url}")

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
            remove_staging(self.cfg)  # every child has exited: what one left half written is garbage
            self.lock.release()
            self.lock = None


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
            console("gyre rl: killing the services now (the next launch resumes the run)")
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
