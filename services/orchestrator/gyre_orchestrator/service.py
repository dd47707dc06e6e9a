"""The orchestrator process: wires environment, replicas, relay, scheduler, packing, stream and eval.

Life of a run (`OrchestratorService.run`):
1. start the gRPC server (health NOT_SERVING), discover replicas, find published weights and make
   the replicas serve the newest (`WeightRelay.start`), wait for the judges, reward models and teacher to
   answer (`startup_timeout_s` each), work out the resume point;
2. health SERVING; the scheduler generates groups under the async bound; each closed step is scored
   into advantages, packed, encoded and pushed to `gyre:{run}:batches`, then logged
   (`orchestrator_steps.jsonl`, metrics) and checkpointed;
3. every `eval.interval` versions (and at start) an evaluation runs in the background;
4. after batch `max_steps`: wait (up to `final_weights_timeout_s`) until the trainer's final weights
   are served by every replica, finish a due evaluation, shut down, exit 0.

Invariant: batch `s` holds only samples whose oldest policy version is >= s-1-k, and every batch
pushed is non-empty and passes `TrainBatch.validate()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from pathlib import Path

from gyre.codec import encode_batch
from gyre.config.loader import reveal
from gyre.config.orchestrator import OrchestratorConfig, template_kwargs
from gyre.endpoint import wait_all_ready
from gyre.envs import Rollout, SamplingParams, ScoringError, Task, load_environment
from gyre.envs.judge import add_to_rubric, held_by
from gyre.events import EVAL, ORCHESTRATOR_STEPS, WEIGHT_RELAY, EventLog, events_dir, latest_per_step, read_events
from gyre.metrics import start_metrics_server
from gyre.net import bind_failure, bind_or_explain
from gyre.redis_retry import Stopped, acall_with_retry
from gyre.rollouts import write_dump
from gyre.runstate import committed_step, trainer_checkpoints
from gyre.steps import StepEntries
from gyre.streams import BatchStream, claim_run_id
from gyre.transport import open_store
from gyre.wandb_log import WandbLogger

from gyre_orchestrator.advantages import overlong_penalty
from gyre_orchestrator.client import InferenceClient, close_replica_clients
from gyre_orchestrator.metrics import OrchestratorMetrics
from gyre_orchestrator.mix import MixTask, TaskMix
from gyre_orchestrator.packing import PackResult, TrainSample, pack_batch
from gyre_orchestrator.progress import ProgressStore
from gyre_orchestrator.records import ScoredRollout, StepRecords
from gyre_orchestrator.relay import WeightRelay
from gyre_orchestrator.replicas import ReplicaSet, make_discovery
from gyre_orchestrator.rescoring import RESCORE_BACKOFF_S, scored_again
from gyre_orchestrator.resume import await_trainer_rewind, find_resume_point, settled_resume_step
from gyre_orchestrator.scheduler import RolloutKey, RolloutScheduler, StepState, VersionWatch
from gyre_orchestrator.server import OrchestratorServer
from gyre_orchestrator.step_samples import step_samples
from gyre_orchestrator.stream_guard import StreamGuard
from gyre_orchestrator.teacher import Teacher
from gyre_orchestrator.training_eval import TrainingEval

log = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9102
# a replica discovery dropped keeps its requests in flight this long: scaled down, its server finishes them in its
# shutdown grace (inference server.shutdown_grace_s, 30 s) and answers the rest 503 (retried); gone, they fail at once
RETIRE_DRAIN_S = 60.0
# a SIGTERM during a push lets it complete this long (a push waits for a Redis in an outage up to
# redis.retry_deadline_s, past any stop grace): well inside a pod's 30 s grace and `gyre rl`'s 15 s
STOP_PUSH_GRACE_S = 10.0


class RolloutFailed(RuntimeError):
    """The environment itself failed during a rollout (not the model, not the network)."""


class OrchestratorService:
    #: the wait before a failed scoring's second attempt (doubling after), `gyre_orchestrator.rescoring`
    rescore_backoff_s = RESCORE_BACKOFF_S

    def __init__(self, cfg: OrchestratorConfig, *, metrics: OrchestratorMetrics | None = None):
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        # label -> environment: one, or the entries of a mix ([[orchestrator.env]], gyre_orchestrator.mix)
        self.envs = {}
        for i, entry in enumerate(cfg.envs):
            try:
                self.envs[entry.key] = load_environment(entry.name, **entry.args)
            except ValueError as e:  # which entry of a mix: "unknown environment" alone did not say
                raise ValueError(f"config key 'env{f'.{i}' if isinstance(cfg.env, list) else ''}': {e}") from e
        self.env = next(iter(self.envs.values()))  # the only one, or a mix's first
        # judges, reward models (and below the teacher): name -> object with `stats`; a mix's entries share them
        self.signals: dict = {}
        for env in self.envs.values():
            self.signals = add_to_rubric(env, cfg.judges, cfg.reward_models, signals=self.signals or None)
        self.teacher = Teacher(cfg.teacher) if cfg.teacher is not None else None
        if self.teacher is not None:
            self.signals["teacher"] = self.teacher
        # and those the environments' own code made (a ported verifiers JudgeRubric's): waited for and counted alike
        self.signals.update(held_by(self.envs, self.signals))
        self.scoring_failures = 0
        self._cut_warned = False  # the first sample of a run cut to batch.seq_len without mask_truncated
        self.reward_errors: dict[str, int] = {}  # reward function -> samples it raised on (scored 0 there)
        self.metrics = metrics or OrchestratorMetrics(cfg.run_id)
        self.sampling = SamplingParams(**cfg.sampling.model_dump())
        # label -> its training sampling: the orchestrator's, with an entry's own sampling.max_tokens (a mix of a
        # math entry's long answers beside short ones) and chat_template_kwargs; the temperature is one for the batch
        self.entry_sampling = {
            entry.key: dataclasses.replace(self.sampling, max_tokens=cfg.max_tokens(entry),
                                           chat_template_kwargs=template_kwargs(cfg.sampling, entry))
            for entry in cfg.envs
        }  # fmt: skip
        self.events = EventLog(events_dir(self.out) / ORCHESTRATOR_STEPS)
        self.eval_events = EventLog(events_dir(self.out) / EVAL)
        self.relay_events = EventLog(events_dir(self.out) / WEIGHT_RELAY)
        self.transport = open_store(cfg.weights, self.out)
        self.wandb = WandbLogger(cfg.wandb, service="orchestrator", run_id=cfg.run_id, output_dir=self.out,
                                 config=cfg)  # fmt: skip
        self.progress = ProgressStore(self.out / "checkpoints" / "orchestrator", keep_last=cfg.ckpt_keep_last,
                                      also_keep=lambda: trainer_checkpoints(self.out))  # fmt: skip
        self.cfg = cfg = settled_resume_step(cfg, self.progress)  # before anything changes (gyre_orchestrator.resume)
        self.spilled = StepEntries(self.out / "batches", suffix=".bin")  # payloads above batch.inline_max_bytes
        inf = cfg.inference
        self.replicas = ReplicaSet(cooldown_s=inf.failure_cooldown_s)
        self.discovery = make_discovery(inf, self.replicas, on_removed=self._on_removed)
        self.client = InferenceClient(
            self.replicas,
            model=inf.model,
            api_key=reveal(inf.api_key),
            reread_key=lambda: inf.reread_secret("api_key"),  # a Secret rotated in place
            max_concurrency=inf.max_concurrency,
            timeout_s=inf.timeout_s,
            retries=inf.retries,
        )
        demand = self.client.demand  # read at scrape time; the gauge holds the dict, not the service
        for state in ("inflight", "queued"):
            self.metrics.labels(self.metrics.model_requests, state=state).set_function(
                lambda state=state: demand[state]
            )
        self.versions = VersionWatch(0)
        self.relay = WeightRelay(
            self.replicas,
            self.transport,
            self.versions,
            events=self.relay_events,
            metrics=self.metrics,
            timeout_s=cfg.relay.timeout_s,
            retries=cfg.relay.retries,
            probe_interval_s=inf.health_interval_s,
            poll_store_s=cfg.relay.poll_store_s,
            control_token=reveal(inf.control_token),
            reread_token=lambda: inf.reread_secret("control_token"),  # a Secret rotated in place
            model=inf.model or "",
        )
        self.server = OrchestratorServer(
            self.relay,
            lambda: self.last_step,
            host=cfg.server.host,
            port=cfg.server.port,
            control_token=reveal(cfg.server.control_token),
        )
        self.redis = cfg.redis.client(socket_timeout=30, socket_connect_timeout=5)
        self.stream = BatchStream(self.redis, cfg.run_id, maxlen=cfg.batch.stream_maxlen)
        self.guard = StreamGuard(self.redis, self.stream, self.metrics, self._redis,
                                 lambda: committed_step(self.out, self.transport.latest()))  # fmt: skip
        self.last_step = 0
        self.sampler: TaskMix | None = None
        self.scheduler: RolloutScheduler | None = None
        self.step_records = StepRecords(
            cfg,
            metrics=self.metrics,
            wandb=self.wandb,
            progress=self.progress,
            signals=self.signals,
            teacher=self.teacher,
        )
        self.evals = TrainingEval(
            cfg, self.envs, self.client, events=self.eval_events, wandb=self.wandb, metrics=self.metrics
        )
        self._metrics_server = None
        self.metrics_port: int | None = None
        self._background: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None  # the task running `run()`, cancelled by `stop()`
        self.stop_requested: str | None = None  # why (e.g. "SIGTERM"): a clean stop, see `stop()`
        self._pushing = False  # between a batch's event line and its progress accounting
        self._push_abandoned = False  # a push left under a stop because Redis was unavailable (`loop`)
        self._stop_timer: asyncio.TimerHandle | None = None  # ends a push that outlasts the stop's grace
        self._pushed_here: int | None = None  # newest step this process pushed and accounted

    # ---- lifecycle ------------------------------------------------------------------------------
    async def run(self) -> int:
        """Start, push batches until `max_steps`, finish; `StreamLost` if Redis lost batches meanwhile;
        `asyncio.CancelledError` after `stop()` (with `stop_requested` set: a clean stop)."""
        self._task = asyncio.current_task()
        try:
            if self.stop_requested:  # a signal that came before this task ran (a StreamLost restart in between)
                raise asyncio.CancelledError
            await self.start()
            work = asyncio.create_task(self._work(), name="work")
            watch = asyncio.create_task(self.guard.watch(lambda: self.last_step), name="watch-stream")
            refused = asyncio.create_task(self.relay.failed(), name="weights-refused")
            try:
                await asyncio.wait({work, watch, refused}, return_when=asyncio.FIRST_COMPLETED)
                if watch.done():
                    watch.result()  # raises StreamLost (or a Redis error past its deadline)
                if refused.done():
                    refused.result()  # raises WeightsRefused: a replica can never serve this run's weights
                return await work
            finally:
                for task in (work, watch, refused):
                    task.cancel()
                await asyncio.gather(work, watch, refused, return_exceptions=True)
        finally:
            if self._stop_timer is not None:  # a push that failed under a stop: the timer must not cut close() short
                self._stop_timer.cancel()
            if self.stop_requested:
                self._save_stop_checkpoint()
            await self.close()

    def stop(self, why: str, push_grace_s: float = STOP_PUSH_GRACE_S) -> None:
        """A clean stop (SIGTERM, SIGINT): generation stops at once (rollouts in flight are abandoned, their tasks
        skipped on resume), but a batch being pushed completes first, up to `push_grace_s` (its line, dump, push,
        count and progress checkpoint: cut between them, the resume rule still copes, but the generated batch was
        thrown away); then a progress checkpoint of the last step pushed, and `run()` raises CancelledError. A
        second call stops at once, push or not."""
        again, self.stop_requested = self.stop_requested is not None, why
        if self._task is None or self._task.done():
            return
        if self._pushing and not again:
            log.info("%s: stopping once batch %d is pushed (up to %.0fs)", why, self.last_step + 1, push_grace_s)
            self._stop_timer = self._task.get_loop().call_later(push_grace_s, self._task.cancel)
            return
        log.info("%s: stopping%s", why, " at once" if again else "")
        self._task.cancel()

    @property
    def stop_cut_short(self) -> bool:
        """A batch's push was cut short (a second signal, or it outlasted the stop's grace): the resume rule
        regenerates or keeps it by what reached the stream. Not one left because Redis was unavailable then (`loop`):
        nothing else could be done, a clean stop."""
        return self._pushing and not self._push_abandoned

    def _save_stop_checkpoint(self) -> None:
        """At a clean stop, the progress of the last step this process pushed, unless `ckpt_interval` already saved
        it: with an interval above 1 the newest checkpoint was up to interval - 1 steps behind the stream, and once
        the trainer had trained the newest batch and Redis trimmed it (or lost it), a restart drew those steps'
        tasks again. Not after a push cut short (its counters are not accounted), nor with checkpoints off."""
        step = self._pushed_here
        if self.cfg.ckpt_interval is None or step is None or self._pushing or step in self.progress.steps():
            return
        self.step_records.save_progress(step, self.sampler.state())
        log.info("progress of step %d saved (checkpoints/orchestrator/step_%d.json)", step, step)

    async def _work(self) -> int:
        await self.loop()
        await self.finish()
        return 0

    async def start(self) -> None:
        cfg = self.cfg
        port = DEFAULT_METRICS_PORT if cfg.metrics.port is None else cfg.metrics.port
        self._metrics_server, self.metrics_port = bind_or_explain(
            lambda: start_metrics_server(port, self.metrics.registry, host=cfg.server.host),
            "orchestrator",
            "metrics.port",
            port,
            cfg.server.host,
        )
        self.metrics.labels(self.metrics.max_async_level).set(cfg.max_async_level)
        try:
            await self.server.start()
        except (OSError, RuntimeError) as e:
            host, port = cfg.server.host, cfg.server.port
            raise bind_failure("orchestrator", host, "server.host", port, "server.port", e) from None
        if cfg.redis.owner:  # before the stream is read or changed (a rewind): another experiment's is not ours
            await self._redis(lambda: claim_run_id(self.redis, cfg.run_id, cfg.redis.owner), "claiming the run id")
        await self.discovery.start()
        if cfg.resume_step is not None and cfg.resume_step >= 0:
            await await_trainer_rewind(self.transport, cfg.resume_step)
        await self.relay.start()
        # health stays NOT_SERVING meanwhile: a judge, reward model or teacher still loading its model (its own pod
        # under the Helm chart) failed the first rollouts' scoring, and after sample_attempts stopped the run
        await wait_all_ready(signal.endpoint for signal in self.signals.values())
        if self.teacher is not None and len(self.replicas):  # before any sample: a teacher of another vocabulary
            await self.teacher.check_tokenizer_once(next(iter(self.replicas)).url, api_key=self.client.api_key)
        if self.relay.target is not None:
            step = self.relay.target.step
            log.info("published weights up to version %d: making replicas serve it", step)
            if not await self.relay.wait_served(step, timeout=cfg.relay.timeout_s):
                log.warning("not every replica serves version %d yet; continuing (the relay keeps trying)", step)
        await self.guard.start()
        point = await self._resume_point()
        self.last_step = point.start_step - 1
        # from the start: a restarted orchestrator's series continues at the last step pushed (it was absent until
        # the resumed run's first push, a gap in every panel and alert on it)
        self.metrics.labels(self.metrics.step).set(self.last_step)
        self.step_records.resume(self._previous_step_line(point.start_step), point.counters)
        self.sampler = self._task_mix(point)
        log.info("starting at step %d (%s), %s; %s", point.start_step, point.reason, self._positions(),
                 self._step_shape())  # fmt: skip
        self.scheduler = self._new_scheduler(point.start_step)
        if cfg.eval.interval is not None:
            self.evals.start(
                self.versions, at_start=cfg.eval.at_start and point.start_step == 1, done=self._evaluated_versions()
            )
        await self.server.set_serving(True)

    def _task_mix(self, point) -> TaskMix:
        """The train tasks from the resume point's positions: its per-entry cursors, or for a run from before mixes
        (its checkpoints hold a task index alone) that index, the one environment's cursor."""
        cfg = self.cfg
        cursors = dict(point.cursors)
        if len(self.envs) == 1 and not point.cursors:
            cursors[cfg.envs[0].key] = point.task_index
        new = [label for label in self.envs if label not in cursors]
        if point.cursors and new:  # day two: an entry added, or one renamed (its label is the key), starts over
            gone = [label for label in point.cursors if label not in self.envs]
            renamed = (f" (the run has positions of {gone}, not in the mix now: a renamed entry starts over; its old "
                       "label, as label = '...', continues it)") if gone else ""  # fmt: skip
            log.warning("environments %s have no saved position in this run: they start at the beginning of their "
                        "train split%s", new, renamed)  # fmt: skip
        return TaskMix(
            {label: env.tasks("train", seed=cfg.seed) for label, env in self.envs.items()},
            {entry.key: entry.ratio for entry in cfg.envs},
            seed=cfg.seed,
            cursors=cursors,
            draws=point.draws,
        )

    def _step_shape(self) -> str:
        """What a step is, said at start: PRIME-RL's batch_size counts samples, Gyre's tasks (a copied batch_size
        generated rollouts_per_example times the samples, silently)."""
        cfg = self.cfg
        sizes = sorted({cfg.group_size(entry) for entry in cfg.envs})
        if len(sizes) == 1:
            return (f"a step: {cfg.batch_size} tasks x {sizes[0]} samples = {cfg.batch_size * sizes[0]} samples "
                    "(batch_size counts tasks)")  # fmt: skip
        return f"a step: {cfg.batch_size} tasks x {sizes[0]}..{sizes[-1]} samples by entry (batch_size counts tasks)"

    def _positions(self) -> str:
        if len(self.envs) == 1:
            return f"task index {self.sampler.index}"
        shares = ", ".join(f"{label} {100 * self.sampler.shares[label]:.0f}% from task {self.sampler.cursors[label]}"
                           for label in self.sampler.labels)  # fmt: skip
        return f"mix of {len(self.envs)} environments after {self.sampler.draws} draws: {shares}"

    def _previous_step_line(self, start_step: int) -> dict | None:
        """The newest line of the last step before `start_step` in orchestrator_steps.jsonl (None: none): what the
        cumulative counts continue from (a rewind's or a regenerated step's newer lines are not before it)."""
        lines = [e for e in latest_per_step(read_events(self.events.path)) if e["step"] < start_step]
        return lines[-1] if lines else None

    def _evaluated_versions(self) -> set[int]:
        """The versions eval.jsonl holds an evaluation of, among those the store still publishes (a rewind deleted the
        newer ones: an eval of such a step was of the abandoned policy, and the step's new version is due again)."""
        latest = self.transport.latest() or 0
        steps = {e.get("step") for e in read_events(self.eval_events.path)}
        return {s for s in steps if isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= latest}

    def _new_scheduler(self, start_step: int) -> RolloutScheduler:
        cfg = self.cfg
        sizes = {entry.key: cfg.group_size(entry) for entry in cfg.envs}
        g = max(sizes.values())  # the default bound on groups at once keeps requests within max_concurrency
        return RolloutScheduler(
            self._generate,
            self.sampler.next,
            self.versions,
            batch_size=cfg.batch_size,
            group_size=cfg.rollouts_per_example,
            max_async_level=cfg.max_async_level,
            start_step=start_step,
            max_steps=cfg.max_steps,
            max_inflight_groups=cfg.max_inflight_groups or math.ceil(cfg.inference.max_concurrency / g),
            # with a teacher every token carries a signal: a group of equal rewards still teaches
            drop_zero_signal=cfg.advantage.drop_zero_signal and self.teacher is None,
            oversample_limit=cfg.advantage.oversample_limit,
            sample_attempts=cfg.sample_attempts,
            trained=lambda: committed_step(self.out, self.transport.latest()),
            on_finished=self._count_rollout,
            group_sizes=sizes,  # by label: a MixTask's `env`
            refill_from_entry=cfg.advantage.refill == "entry" and len(self.envs) > 1,
            length_keys={entry.key: cfg.max_tokens_key(i) for i, entry in enumerate(cfg.envs)},
        )

    def _count_rollout(self, sample: ScoredRollout, stale: bool) -> None:
        """`gyre_orchestrator_rollouts_total`: a finished rollout counts once, as `stale` when admission dropped it
        (counted `ok` and then `stale` too before, so the outcomes summed to more rollouts than there were)."""
        outcome = "stale" if stale else "truncated" if sample.rollout.truncated else "ok"
        self.metrics.labels(self.metrics.rollouts, env=sample.env, outcome=outcome).inc()

    async def _resume_point(self):
        return await find_resume_point(self.cfg, self.out, self.progress, self.transport, self.stream, self._redis)

    async def _redis(self, op, what: str, *, during_push: bool = False):
        """A Redis call that survives an outage of up to `redis.retry_deadline_s` (and stops on SIGTERM). A push's
        calls run on through a stop (`stop`), but not through an outage then: `Stopped` (see `loop`)."""
        should_stop = (lambda: self.stop_requested is not None) if during_push else None
        return await acall_with_retry(op, what=what, should_stop=should_stop,
                                      deadline_s=self.cfg.redis.retry_deadline_s)  # fmt: skip

    async def loop(self) -> None:
        cfg = self.cfg
        while cfg.max_steps is None or self.last_step < cfg.max_steps:
            st = await self.scheduler.next_batch()
            self._pushing = True  # a stop waits for it (`stop`); left True when the push is cut short
            try:
                await self.push(st)
            except Stopped:
                # Redis unavailable under a stop (`helm uninstall` stops it with us): waiting out the grace would
                # only end in a cut (exit 143). Nothing acknowledged is lost: the step's progress is not saved, so
                # a restart generates it again, or keeps it if its XADD reached the stream (the resume rule).
                log.info("redis unavailable while stopping: batch %d left to the resume rule", st.step)
                self._push_abandoned = True
                raise asyncio.CancelledError from None
            self._pushing = False
            self._pushed_here = st.step
            if self.stop_requested:  # it came during the push (its grace timer is cancelled on the way out)
                raise asyncio.CancelledError

    async def finish(self) -> None:
        cfg = self.cfg
        await self.scheduler.stop()
        if cfg.max_steps is not None and cfg.final_weights_timeout_s > 0:
            log.info(
                "all %d batches pushed; waiting up to %.0fs for weights version %d "
                "(final_weights_timeout_s = 0 skips this when no trainer runs)",
                cfg.max_steps,
                cfg.final_weights_timeout_s,
                cfg.max_steps,
            )
            deadline = time.monotonic() + cfg.final_weights_timeout_s
            while self.relay.latest_step < cfg.max_steps and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            served = self.relay.latest_step >= cfg.max_steps and await self.relay.wait_served(
                cfg.max_steps, timeout=max(0.0, deadline - time.monotonic())
            )
            if served:
                log.info("final weights version %d served by every replica", cfg.max_steps)
            else:
                log.warning(
                    "final weights version %d not relayed within %.0fs", cfg.max_steps, cfg.final_weights_timeout_s
                )
        await self.evals.finish(self.versions.value)  # a due evaluation (e.g. of the final version) finishes first

    async def close(self) -> None:
        await self.server.set_serving(False)
        if self.scheduler is not None:
            await self.scheduler.stop()
        for task in list(self._background):  # replicas still retiring: their clients close now
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.evals.stop()
        for env in self.envs.values():
            aclose = getattr(env, "aclose", None)  # environments holding servers (verifiers) release them
            if aclose is not None:
                await aclose()
        for signal in self.signals.values():
            await signal.aclose()
        await self.relay.stop()
        await self.discovery.stop()
        await self.server.stop(grace=1.0)
        await close_replica_clients(list(self.replicas))
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        self.redis.close()
        for events in (self.events, self.eval_events, self.relay_events):
            events.close()
        self.wandb.finish()

    def _on_removed(self, removed) -> None:
        for r in removed:
            for gauge in (self.metrics.replica_version, self.metrics.replica_up):
                with contextlib.suppress(KeyError):  # never exported
                    gauge.remove(self.cfg.run_id, r.url)
        task = asyncio.get_running_loop().create_task(self._retire(removed))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _retire(self, removed, drain_s: float = RETIRE_DRAIN_S) -> None:
        """Let the requests in flight on replicas discovery dropped finish (up to `drain_s`; the rest are cancelled
        and retried elsewhere), then close their clients. A scale-down removes a pod from its Service while it still
        answers what it holds; closing its clients at once aborted all of that work (32 requests of a step, retried
        on the others, each using up one of its `inference.retries`) and logged the replica as failed."""
        try:
            calls = [call for r in removed for call in r.calls if not call.done()]
            if calls:
                log.info("replicas %s left: letting their %d requests in flight finish (up to %.0fs)",
                         [r.url for r in removed], len(calls), drain_s)  # fmt: skip
                _, late = await asyncio.wait(calls, timeout=drain_s)
                for call in late:
                    call.cancel()  # retried on a replica in rotation (`InferenceClient`: ReplicaStopped)
                await asyncio.gather(*late, return_exceptions=True)
        finally:
            await close_replica_clients(removed)

    # ---- one rollout ----------------------------------------------------------------------------
    async def _generate(self, item: MixTask, floor: int, key: RolloutKey) -> ScoredRollout:
        index, task, env_name = item.index, item.task, item.env
        env = self.envs[env_name]
        start = time.monotonic()
        # with sampling.seed: a seed per (step, task, rollout), so a group's rollouts differ and a rerun repeats them;
        # in a mix per entry too (task i of two entries in one step had the same seeds)
        where = (index,) if len(self.envs) == 1 else (env_name, index)
        retry = ("retry", key.retry) if key.retry else ()  # a failed attempt's retry: a fresh seed (RolloutKey)
        sampling = self.entry_sampling[env_name].for_request("train", key.step, *where, key.index, *retry)
        # priority = the batch: a backlog beyond the engines' rows never delays an older batch (client.py)
        rollout = await env.rollout(self.client.for_version(floor, priority=key.step), task, sampling)
        if rollout.error:
            self.metrics.labels(self.metrics.rollouts, env=env_name, outcome="error").inc()
            raise RolloutFailed(f"task {task.id}: {rollout.error}")

        def failed(_error: BaseException) -> None:
            self.scoring_failures += 1
            self.metrics.labels(self.metrics.scoring_failures, env=env_name).inc()

        # a failed judge, reward model or teacher: this completion is scored again, never generated again (which
        # left out of training the completions a signal failed on) nor a silent 0; ScoringFailed stops the run
        again = {"attempts": self.cfg.sample_attempts, "what": f"task {task.id}", "on_failure": failed,
                 "backoff_s": self.rescore_backoff_s}  # fmt: skip
        try:
            score = await scored_again(lambda: env.score(task, rollout), **again)
        except ScoringError as error:  # not `rescorable` (scored inside a verifiers episode): generated again
            raise RolloutFailed(f"task {task.id}: scoring failed: {error}") from error
        teacher = await scored_again(lambda: self._teacher_logprobs(rollout), **again)  # the score is kept
        self._note_reward_errors(task, score.errors)
        seconds = time.monotonic() - start
        self.metrics.labels(self.metrics.rollout_latency, env=env_name).observe(seconds)  # its outcome: on admission
        # DAPO's overlong shaping: the sample's model tokens (all turns) against its generation budget, the entry's
        # max_tokens per turn x the environment's turns (a single-turn one: max_tokens, as in DAPO), or x the turns
        # the episode took where more: a verifiers harness without agent.max_turns decides its own (the environment
        # says 1), and its every multi-turn episode was shaped as overlong against a single turn's budget
        buffer = self.cfg.advantage.overlong_buffer
        turns = max(getattr(env, "max_turns", 1), rollout.sequence_turns)
        penalty = overlong_penalty(rollout.num_completion_tokens, self.entry_sampling[env_name].max_tokens * turns,
                                   buffer.len, buffer.penalty_factor)  # fmt: skip
        return ScoredRollout(task=task, task_index=index, rollout=rollout, score=score, seconds=seconds,
                             teacher_logprobs=teacher, env=env_name, draw=item.draw,
                             overlong_penalty=penalty)  # fmt: skip

    def _note_reward_errors(self, task: Task, errors: dict[str, str]) -> None:
        """A reward function that raised scores 0 (a reward bug must not stop training) but is never silent: its
        first failure is logged with the exception, and every one is counted (`reward_errors` in the step lines)."""
        for name, message in errors.items():
            self.reward_errors[name] = self.reward_errors.get(name, 0) + 1
            if self.reward_errors[name] == 1:
                log.warning("reward function %r failed on task %s and scored 0: %s (further failures are only "
                            "counted: reward_errors in orchestrator_steps.jsonl; a dumped sample's details name it)",
                            name, task.id, message)  # fmt: skip

    async def _teacher_logprobs(self, rollout: Rollout) -> list[float] | None:
        """The teacher's log-prob of each token the sample trains on (the sequence cut to `batch.seq_len`), 0 where
        the student did not sample (prompt, environment and tool tokens)."""
        if self.teacher is None:
            return None
        if len(self.replicas):  # done at start unless no replica was known then (a fleet still starting)
            await self.teacher.check_tokenizer_once(next(iter(self.replicas)).url, self.client.api_key)
        ids = rollout.token_ids[: self.cfg.batch.seq_len]
        values = await self.teacher.logprobs(ids)
        if values is None:  # the teacher refused this sample (counted, logged once): it trains on its reward alone
            return None
        return [value if sampled else 0.0 for value, sampled in zip(values, rollout.loss_mask, strict=False)]

    # ---- one batch ------------------------------------------------------------------------------
    def build_batch(
        self, st: StepState, records: list[dict] | None = None
    ) -> tuple[list[TrainSample], PackResult, int, int]:
        """The step's samples (`step_samples`) packed into the batch the trainer gets: (samples, packed, number cut
        to seq_len, number left out as truncated)."""
        cfg = self.cfg
        built = step_samples(st, cfg, self.sampling.temperature, self.teacher is not None, records)
        samples, cut, masked = built.samples, built.cut, built.masked
        if cut and not cfg.advantage.mask_truncated and not self._cut_warned:
            self._cut_warned = True
            log.warning("step %d: %d sample(s) longer than batch.seq_len = %d were cut to it and train on their prefix "
                        "with the whole reply's reward; raise trainer.data.seq_len, lower sampling.max_tokens or set "
                        "advantage.mask_truncated (counted: truncated_to_seq_len; logged once)", st.step, cut,
                        cfg.batch.seq_len)  # fmt: skip
        if not samples:
            raise RuntimeError(f"step {st.step}: every sample was empty after truncation (no sampled token within "
                               "batch.seq_len); raise batch.seq_len")  # fmt: skip
        packed = pack_batch(
            st.step,
            samples,
            seq_len=cfg.batch.seq_len,
            world_size=cfg.batch.dp_world_size,
            temperature=self.sampling.temperature,
            # budget: Dr.GRPO's normaliser (a mix: its longest episodes', each entry's turns of its own max_tokens)
            max_tokens=max(
                self.entry_sampling[key].max_tokens * getattr(env, "max_turns", 1) for key, env in self.envs.items()
            ),
        )
        return samples, packed, cut, masked

    async def push(self, st: StepState) -> None:
        cfg = self.cfg
        start = time.monotonic()
        interval = cfg.rollouts.interval
        records = [] if interval is not None and (st.step == 1 or st.step % interval == 0) else None
        samples, packed, cut, masked = self.build_batch(st, records)
        payload = await asyncio.to_thread(encode_batch, packed.batch)
        if await asyncio.to_thread(self._trained_meanwhile, st.step, len(samples)):
            self.last_step = st.step
            return
        masked = masked if cfg.advantage.mask_truncated else None  # off: the step line has no such key
        record = self.step_records.record(
            st, samples, packed, cut, time.monotonic() - start, self.scoring_failures, self.reward_errors, masked
        )
        # The step's line and its rollout dump go before the push: killed between them and the push, the resumed run
        # pushes this step again, and its newer line replaces this one (readers keep the newest record per step), its
        # dump this dump (written whole, replaced whole). After the push, a kill in between would leave a pushed step
        # without any line, or a trained step without its dump.
        self.events.append(record)
        if records:
            await asyncio.to_thread(write_dump, self.out, st.step, records)
        entry_id = await self._redis(
            lambda: self.stream.push(
                st.step, payload, path_threshold=cfg.batch.inline_max_bytes, spill_dir=self.spilled.root
            ),
            f"pushing batch {st.step}",
            during_push=True,
        )
        await self.guard.pushed(st.step, entry_id)
        self.last_step = st.step
        await self._redis(self.guard.note_redis_memory, "reading redis memory", during_push=True)
        await asyncio.to_thread(self._prune_spilled)
        self.step_records.account(st, record, [s.meta["lag"] for s in samples], positions=self.sampler.state())
        if records:
            self.wandb.samples(records, st.step)

    def _trained_meanwhile(self, step: int, samples: int) -> bool:
        """Whether the trainer committed `step` while this process generated its batch again: the stream was lost
        (Redis restarted without its data, flushed) while the trainer trained the batch it had read before, and the
        resume rule, seeing the step not yet committed, generated it again. Pushed, this batch replaced the step's
        event line and rollout dump while the trainer skipped it as a replay: the records described a batch nobody
        trained (with a real model a step takes minutes, so a Redis restart lands in one). Not pushed, the step's
        line stays the trained batch's; these samples are dropped."""
        if step > committed_step(self.out, self.transport.latest()):
            return False
        log.warning("step %d was trained from the batch pushed before the stream was lost (the trainer committed it "
                    "while this batch was generated again): not pushing it, its %d samples are dropped", step,
                    samples)  # fmt: skip
        return True

    def _prune_spilled(self) -> None:
        """Delete the spilled payloads of steps before the trainer's committed one: trained, never read again (a
        replay of a trained step is skipped by its step number). The committed step's own file stays: the newest
        entry's task positions are read from it on a restart."""
        committed = committed_step(self.out, self.transport.latest())
        self.spilled.remove([s for s in self.spilled.steps() if s < committed])
