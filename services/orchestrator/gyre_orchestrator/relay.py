"""Weight relay: bring every inference replica to the newest published weights version.

The trainer announces a `WeightsVersion` with `NotifyWeights` (see `server.py`); the relay also finds
versions on its own — on start (the transport's `latest()`: replicas are made to serve it before any
rollout) and by polling every `poll_store_s`, so a lost notification only delays a version. What is
transport-specific is delegated to the transport's store side (`gyre.transport`): checking an
announcement (`resolve`), finding versions (`latest`) and keeping served ones (`hold`). The folder
transport is fetched by each replica on its own, so the relay runs one updater per replica.

Reconciliation, not fire-and-forget: a loop compares each replica's served version with the target
and runs one updater task per lagging replica (`UpdateWeights(version)` with a deadline,
retried with backoff; a replica that refused the version, FAILED_PRECONDITION, keeps serving its own in rotation
and is sent it again after a pause). A slow or dead replica therefore never holds back the others, and a replica
that restarted on the base model (seen by the periodic `GetStatus` probe) is brought back up. A refusal for good,
INVALID_ARGUMENT (weights that do not fit the model the replica serves: the trainer trains another model, or a
replica's [inference.lora] is smaller than the trainer's adapter), by ANY replica is the run's end: `failed()` raises
`WeightsRefused` naming the replica, the version and its reason, which stops the run, and nothing is sent again. The
replicas are one deployment serving one policy: going on without that replica left it in rotation on its old version
(resent the refused one after every pause, for ever), so the run silently served two policies, or stalled at the async
bound waiting for it. Every
call is logged to `weight_relay.jsonl`. Versions replicas still serve, the target and the versions replicas are
being sent (an update under way while a newer version came, or one past its deadline that the replica may still be
loading, until the replica answers a later update or reports that version or a newer one) are declared with the
transport's `hold`, so the trainer's pruning never deletes weights in use or being loaded.

Versions only move forward, except when the trainer rewinds (`ckpt.resume_step`): it deletes the
versions newer than the step it rewinds to, so a target or a replica version newer than every version
the store still holds was abandoned. Then the target goes back to the announced (or newest stored)
version and replicas ahead of it get `UpdateWeights(rollback=true)`. A late announcement of an old
step while the target is still stored changes nothing, and a replica ahead of a target that is still
stored is left alone (the inference server itself refuses older versions without `rollback`).
A rewind to the base model (`ckpt.resume_step = 0`) deletes every version: with the store empty, the
target is cleared and replicas serving any version get `ReloadWeights` (version 0). An abandoned
version never raises the policy version (`VersionWatch`) the scheduler tags rollouts with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc
from gyre.endpoint import RotatingKey
from gyre.events import EventLog
from gyre.transport import WeightSink
from gyre.v1 import inference_pb2, inference_pb2_grpc
from gyre.weights import WeightsError, WeightsVersion

from gyre_orchestrator.replicas import Replica, ReplicaSet
from gyre_orchestrator.scheduler import VersionWatch

log = logging.getLogger(__name__)

HOLDER = "orchestrator"
# the codes of an UpdateWeights that may have reached a replica still loading the version when the call ended. Not
# UNAVAILABLE: no process answers there (down, restarted) or it said it is not loaded yet, so nothing loads there, and
# a replica down for long was sent, and held, every version published meanwhile (pruning stopped for the whole run)
NO_ANSWER = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class WeightsRefused(RuntimeError):
    """A replica refused the run's weights version for good: it does not fit the model it serves."""


class WeightRelay:
    """Keeps replicas on the newest weights version. Use from one event loop; `start()` then `stop()`."""

    def __init__(
        self,
        replicas: ReplicaSet,
        transport: WeightSink,
        versions: VersionWatch,
        *,
        events: EventLog | None = None,
        metrics: Any = None,
        timeout_s: float = 120.0,
        retries: int = 3,
        backoff_s: float = 1.0,
        probe_interval_s: float = 2.0,
        probe_timeout_s: float = 5.0,
        poll_store_s: float = 5.0,
        control_token: str | None = None,
        reread_token: Callable[[], str | None] | None = None,
        holder: str = HOLDER,
        model: str = "",
    ):
        self.replicas = replicas
        self.transport = transport
        self.versions = versions
        self.events = events
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.poll_store_s = poll_store_s
        # an UNAUTHENTICATED answer reads `reread_token` (inference.control_token_file) again: a Secret rotated in
        # place is taken up by the next probe or update, as the inference client takes up a rotated api key
        self.token = RotatingKey(control_token, reread_token, name="inference control",
                                 setting="inference.control_token_file")  # fmt: skip
        self.holder = holder
        # the served model this run's versions are for: "" = the replica's model itself; a run's name =
        # its LoRA adapter on replicas serving several runs (multi-run, docs/architecture.md)
        self.model = model
        self.target: WeightsVersion | None = None
        self._learned_at: dict[int, float] = {}  # version -> when we learned of it (relay duration)
        self._updaters: dict[str, asyncio.Task] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._probing: dict[str, asyncio.Task] = {}  # url -> its status probe under way (the loop does not wait)
        self._in_use: set[int] | None = None
        # replica url -> versions it was sent whose outcome is not known yet: an UpdateWeights under way, or one that
        # got no answer (past its deadline, a broken connection) while the replica goes on loading it (it finishes a
        # load its caller gave up on). Held like served ones, so that a newer target does not leave them to the
        # trainer's pruning while the replica still reads their files; a version leaves once the replica answers a
        # later update (it serialises them: the earlier load ended) or reports serving it or a newer one
        self._sending: dict[str, set[int]] = {}
        # replica url -> (step, until): the replica refused version `step` (FAILED_PRECONDITION: it answered, checked
        # the version and kept serving its own): not asked for that step again before `until` (monotonic)
        self._refused: dict[str, tuple[int, float]] = {}
        self.failure: WeightsRefused | None = None
        self._failed = asyncio.Event()
        self._last_probe = float("-inf")
        self._last_poll = float("-inf")
        replicas.add_listener(self._on_replicas_changed)
        if metrics is not None:  # the base model (0) until a version is learned: the series exists from the start,
            metrics.labels(metrics.latest_weights).set(0)  # so alerts on it see the run before its first publish

    # ---- announcements --------------------------------------------------------------------------
    @property
    def latest_step(self) -> int:
        return self.target.step if self.target else 0

    def notify(self, announced: WeightsVersion) -> bool:
        """Learn of a version (idempotent). Returns True if it is newer than what we had.

        Raises `WeightsError` when the transport does not hold that version or its digest differs from
        the announced one: relaying it would make every replica fail the same way. ValueError: a version
        that is not relayable at all (step 0, another transport).
        """
        step = announced.step
        if step < 1:
            raise ValueError(f"weights step must be >= 1 (version 0 is the base model), got {step}")
        if announced.transport != self.transport.transport:
            raise ValueError(
                f"version.transport is {announced.transport!r}; this run relays {self.transport.transport!r}"
            )
        if self.target is not None and step < self.target.step and not self._abandoned(self.target.step):
            return False  # a late or repeated announcement: the target is still published
        new = self.transport.resolve(step, announced.digest)  # WeightsError if missing, incomplete or different
        if announced.locator:  # the trainer's name for it (replicas mount the volume where the trainer does)
            new = WeightsVersion(step, new.digest, new.transport, announced.locator)
        if self.target is not None and (self.target.step, self.target.digest) == (step, new.digest):
            return False
        republished = self.target is not None and self.target.step == step
        if self.target is not None and step < self.target.step:
            log.warning("the trainer rewound: weights step %d are gone; going back to step %d", self.target.step, step)
        self.target = new
        self._learned_at.setdefault(step, time.monotonic())
        if republished:  # same step, different files: every replica on it must reload
            log.warning("weights step %d were republished with new files; relaying again", step)
            for r in self.replicas:
                if r.version == step:
                    r.version = step - 1
        log.info("new weights version %d (%s %s)", step, new.transport, new.locator)
        if self.metrics is not None:
            self.metrics.labels(self.metrics.latest_weights).set(step)
        self._wake.set()
        return True

    def poll_store(self) -> None:
        """Pick up a version the trainer published but whose notification we missed, or a rewind."""
        latest = self.transport.latest()
        if latest is None and self.target is not None:
            log.warning("the trainer rewound to the base model: weights step %d are gone", self.target.step)
            self.target = None
            if self.metrics is not None:
                self.metrics.labels(self.metrics.latest_weights).set(0)
            self._wake.set()
        elif latest is not None and (latest > self.latest_step or self._abandoned(self.latest_step, latest)):
            try:
                self.notify(WeightsVersion(latest, "", self.transport.transport))
            except WeightsError as e:
                log.warning("cannot use weights step %d found on the volume: %s", latest, e)

    def _abandoned(self, step: int, latest: int | None = None) -> bool:
        """True when version `step` is newer than every version the store holds: a rewinding trainer
        deleted it (pruning only ever deletes versions older than the newest)."""
        latest = self.transport.latest() if latest is None else latest
        return step > (latest or 0)

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Find published versions, learn what replicas serve, start relaying; returns at once."""
        self.poll_store()
        await self.probe_all()
        self._task = asyncio.create_task(self._run(), name="weight-relay")

    async def stop(self) -> None:
        tasks = [t for t in [self._task, *self._probing.values(), *self._updaters.values()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._updaters.clear()
        self._probing.clear()
        self._task = None

    async def wait_served(self, step: int, timeout: float | None = None) -> bool:
        """True once every replica in rotation (and at least one) serves version >= step."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._all_serve(step):
                return True
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            await asyncio.sleep(0.05 if remaining is None else min(0.05, remaining))

    def _all_serve(self, step: int) -> bool:
        live = [r for r in self.replicas if self.replicas.in_rotation(r)]
        # confirmed: a replica whose cooldown ended is back in rotation before a probe says what it serves now
        return bool(live) and all(r.confirmed and r.version is not None and r.version >= step for r in live)

    async def failed(self) -> None:
        """Returns never; raises `WeightsRefused` once a replica refused a version for good."""
        await self._failed.wait()
        raise self.failure

    def _refused_for_good(self, replica: Replica, step: int, reason: str) -> None:
        """A replica refused version `step` for good (INVALID_ARGUMENT): the run ends (`failed`), nothing is sent again.
        One replica is enough: the others serve the version it cannot, so going on mixed the policies it generates
        with (or waited for it at the async bound for ever)."""
        if self.failure is not None:
            return
        what = f"adapter {self.model!r}" if self.model else "the model it serves"
        hint = ("The trainer's [trainer.lora] must fit every replica's [inference.lora] (max_rank) and model"
                if self.model else "The trainer must train the model every replica serves (trainer model.name = "
                "inference model.name)")  # fmt: skip
        others = sum(1 for r in self.replicas if r.url != replica.url and r.version == step)
        self.failure = WeightsRefused(
            f"inference replica {replica.url} refused weights version {step} for good: it does not fit {what} "
            f"({reason}); {others} other replica(s) serve it. {hint}; stopping the run, which resumes once every "
            "replica can load it"
        )
        log.error("%s", self.failure)
        self._failed.set()

    # ---- the loop -------------------------------------------------------------------------------
    def _on_replicas_changed(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            now = time.monotonic()
            if now - self._last_poll >= self.poll_store_s:
                self._last_poll = now
                self.poll_store()
            if now - self._last_probe >= self.probe_interval_s or self.replicas.probe_requested:
                self.replicas.probe_requested = False
                self._last_probe = now
                # in the background, each replica's on its own: a replica that does not answer holds its probe for
                # probe_timeout_s, and awaited here it held back every replica's update too (a new version reached
                # the others 5 s late, each time a frozen replica came back from its cooldown), and in one round
                # every other replica's next probe. What a probe finds wakes this loop (a listener).
                self._probing = {url: t for url, t in self._probing.items() if not t.done()}
                for r in self._due_probes():
                    if r.url not in self._probing:
                        self._probing[r.url] = asyncio.create_task(self.probe(r), name=f"relay-probe-{r.url}")
            self.reconcile()
            # asyncio.timeout, not wait_for: on Python 3.11 a wait_for whose event was set just as stop() cancelled
            # this task returned normally, the cancellation was lost, and stop() waited for this loop for ever
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(self.probe_interval_s, self.poll_store_s)):
                    await self._wake.wait()

    def reconcile(self) -> None:
        """Start an updater for each lagging replica; publish versions, in-use set and metrics."""
        target = self.target
        target_step = target.step if target is not None else 0  # no target: the base model, version 0
        ahead = [r.version for r in self.replicas if r.version is not None and r.version > target_step]
        latest = self.transport.latest() if ahead else None  # only when some replica is ahead (rare)
        for r in self.replicas:
            behind = target is not None and (r.version is None or r.version < target_step)
            abandoned = r.version is not None and r.version > target_step and self._abandoned(r.version, latest)
            # with no target only a rewind to the base model moves replicas; a run's adapter has no base version
            lagging = behind or (abandoned and (target is not None or not self.model))
            busy = r.url in self._updaters and not self._updaters[r.url].done()
            refused, until = self._refused.get(r.url, (None, 0.0))
            busy |= refused == target_step and time.monotonic() < until
            busy |= self.failure is not None  # a refusal for good ended the run: nothing is sent again
            if lagging and not busy and self.replicas.in_rotation(r):
                self._updaters[r.url] = asyncio.create_task(self._update(r), name=f"relay-{r.url}")
        best = self.replicas.max_healthy_version()
        if best is not None and best > target_step and self._abandoned(best, latest):
            best = None  # a version the trainer rewound away from is no policy version of this run
        if best is not None:
            self.versions.set(best)
        for step in [s for s in self._learned_at if self._all_serve(s)]:
            seconds = time.monotonic() - self._learned_at.pop(step)
            log.info("weights version %d served by every replica in rotation (%.2fs)", step, seconds)
            if self.metrics is not None:
                self.metrics.labels(self.metrics.relay_duration).observe(seconds)
        self._declare_in_use()
        self._export_replicas()

    def _declare_in_use(self) -> None:
        in_use = self.replicas.served_versions() | ({self.target.step} if self.target else set())
        for url in self._sending.keys() - self.replicas.replicas.keys():  # discovery dropped it: it reads nothing more
            del self._sending[url]
        in_use |= {s for sent in self._sending.values() for s in sent}
        in_use = {s for s in in_use if s >= 1}  # version 0 is the base model, not in the store
        if in_use != self._in_use:
            try:
                self.transport.hold(self.holder, in_use)
                self._in_use = in_use
            except OSError as e:
                log.warning("cannot declare weights in use %s: %s", sorted(in_use), e)

    def _export_replicas(self) -> None:
        if self.metrics is None:
            return
        for r in self.replicas:
            self.metrics.labels(self.metrics.replica_version, replica=r.url).set(-1 if r.version is None else r.version)
            self.metrics.labels(self.metrics.replica_up, replica=r.url).set(1 if self.replicas.in_rotation(r) else 0)

    # ---- gRPC -----------------------------------------------------------------------------------
    def _stub(self, replica: Replica) -> inference_pb2_grpc.InferenceControlStub:
        channel = replica.clients.get("channel")
        if channel is None:
            channel = replica.clients["channel"] = grpc.aio.insecure_channel(replica.endpoint.control)
        return inference_pb2_grpc.InferenceControlStub(channel)

    @property
    def metadata(self) -> tuple | None:
        return (("authorization", f"Bearer {self.token.value}"),) if self.token.value else None

    def _control_error(self, replica: Replica, error: grpc.aio.AioRpcError, sent: str | None) -> str:
        """What a failed control call says, with the settings to check (the server's details name none); a refused
        token is read again (a rotated Secret: the next call sends the new one)."""
        code = error.code()
        reason = f"{code.name}: {error.details()}"
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            try:
                if self.token.rekey(401, sent):
                    return f"{reason} (inference.control_token_file changed: the next call sends the new token)"
            except ValueError as reread:
                return f"{reason} (re-reading the token: {reread})"
            return f"{reason} (check inference.control_token / control_token_file)"
        if code == grpc.StatusCode.UNAVAILABLE and replica.version is None:  # never answered: a port, not a restart
            return (f"{reason} (no answer from its control at {replica.endpoint.control} yet: check "
                    "inference.control_urls / control_port, the 'control:' address gyre inference prints)")  # fmt: skip
        return reason

    async def probe(self, replica: Replica) -> None:
        """GetStatus: the authoritative served version (may go down after a restart) and readiness."""
        sent = self.token.value
        try:
            status = await self._stub(replica).GetStatus(
                inference_pb2.GetInferenceStatusRequest(model=self.model),
                timeout=self.probe_timeout_s,
                metadata=self.metadata,
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:  # no process there: it loads none of what it was sent
                self._sending.pop(replica.url, None)
            was_in_rotation = self.replicas.in_rotation(replica)
            # during its cooldown this only marks it down (no longer cooldown): it rejoins when a probe answers
            self.replicas.mark_failed(replica, f"GetStatus: {self._control_error(replica, e, sent)}", probe=True)
            if was_in_rotation:  # no answer: its requests in flight would wait out their HTTP timeout (frozen)
                self.replicas.abandon(replica)
            return
        if not status.ready:  # still loading its model (restarted, or new): no request, no update before it is
            self._sending.pop(replica.url, None)  # restarted (or stopping): it loads none of what it was sent before
            self.replicas.mark_failed(replica, "GetStatus: not ready", probe=True)
            return
        if not self.replicas.in_rotation(replica) and not replica.probe_failed:
            return  # out for failed requests while it answers its probes: its cooldown stands (the circuit breaker)
        self._settle(replica, int(status.step))
        # in rotation, or back from being down (no answer, or loading): it rejoins now, not when its cooldown ends
        self.replicas.mark_ok(replica, int(status.step))

    def _settle(self, replica: Replica, served: int) -> None:
        """The replica reports serving version `served`: a version it was sent up to that one is loaded (or passed
        over for a newer one), so no longer held for its sake."""
        sent = self._sending.get(replica.url)
        if sent:
            sent.difference_update({s for s in sent if s <= served})

    async def probe_all(self) -> None:
        self._last_probe = time.monotonic()
        await asyncio.gather(*(self.probe(r) for r in self._due_probes()))

    def _due_probes(self) -> list[Replica]:
        """Every replica, those in their cooldown too. A failed replica is "in rotation" again once its cooldown is
        over and the probe is how it comes back; one that is down (its probe fails or says not ready: killed,
        restarting, loading its model) rejoins and gets the current weights as soon as a probe finds it ready. Only
        replicas in rotation were probed: a restarting replica's cooldown doubled with each probe while it loaded,
        and once ready it sat out the rest of it (10 s, up to 60 s) before the relay updated it."""
        return list(self.replicas)

    async def _update(self, replica: Replica) -> None:
        """Bring one replica to the target version (retries with backoff, then out of rotation, or for a refusal a
        pause before the same version is sent again)."""
        for attempt in range(self.retries + 1):
            if attempt:  # before deciding: a newer version may have come, or the replica left, meanwhile
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            target = self.target
            if replica.url not in self.replicas.replicas:
                return
            step = target.step if target is not None else 0
            rollback = replica.version is not None and replica.version > step
            if replica.version == step or (rollback and not self._abandoned(replica.version)):
                return
            if target is None and (self.model or not rollback):
                return
            start = time.monotonic()
            error, unavailable, refused, incompatible = None, False, False, False
            sent = self.token.value
            if target is not None:  # declared before the call: the trainer prunes what no holder declared
                self._sending.setdefault(replica.url, set()).add(step)
                self._declare_in_use()
            answered = True
            try:
                if target is None:  # rewound to the base model
                    call = self._stub(replica).ReloadWeights(
                        inference_pb2.ReloadWeightsRequest(), timeout=self.timeout_s, metadata=self.metadata
                    )
                else:
                    request = inference_pb2.UpdateWeightsRequest(
                        version=target.to_proto(), rollback=rollback, model=self.model
                    )
                    call = self._stub(replica).UpdateWeights(request, timeout=self.timeout_s, metadata=self.metadata)
                reply = await call
            except grpc.aio.AioRpcError as e:
                error = self._control_error(replica, e, sent)
                unavailable = e.code() == grpc.StatusCode.UNAVAILABLE
                refused = e.code() == grpc.StatusCode.FAILED_PRECONDITION
                # INVALID_ARGUMENT: no retry can load it (weights that do not fit, a malformed announcement)
                incompatible = e.code() == grpc.StatusCode.INVALID_ARGUMENT
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # a load slower than the deadline fails every retry
                    error += (f" (not loaded within relay.timeout_s = {self.timeout_s:g} s: raise it if loading a "
                              "version takes this replica longer)")  # fmt: skip
                # no answer in time: the replica may be loading the version still (or never got the call)
                answered = e.code() not in NO_ANSWER
            if answered:  # updates are serialised on the replica: every version sent before this call has loaded or not
                self._sending.pop(replica.url, None)
            seconds = time.monotonic() - start
            self._record(step, replica, error is None, seconds, error, attempt)
            if error is not None and unavailable:
                # down, or still loading its model ("the model is not loaded yet"): retrying on a backoff burned the
                # retries and then a cooldown; its status probe now says when it is ready, and reconcile updates it
                log.info("UpdateWeights(%d) on %s: %s; updating it once its status probe says it is ready", step,
                         replica.url, error)  # fmt: skip
                self.replicas.mark_failed(replica, f"UpdateWeights: {error}", probe=True)
                return
            if error is None:
                self.replicas.mark_ok(replica, int(reply.step))
                log.info("replica %s now serves version %d (%.2fs)", replica.url, reply.step, seconds)
                self.reconcile()
                return
            log.warning("UpdateWeights(%d) on %s failed: %s", step, replica.url, error)
            if incompatible:
                break
        if incompatible:
            self._refused_for_good(replica, step, error)
            return
        if refused:
            # the replica is healthy and serves its version, which the async bound routes by: out of rotation it
            # generated nothing for the batches that version may serve (e.g. a volume that shows the replica a new
            # version late); a newer version is sent at once, this one again after a pause
            pause = self.backoff_s * 2**self.retries
            self._refused[replica.url] = (step, time.monotonic() + pause)
            log.warning("replica %s refused weights version %d %d times; it serves version %s meanwhile, and is "
                        "sent that version again in %.0fs", replica.url, step, self.retries + 1, replica.version,
                        pause)  # fmt: skip
            return
        self.replicas.mark_failed(replica, f"UpdateWeights failed {self.retries + 1} times: {error}")

    def _record(self, step: int, replica: Replica, ok: bool, seconds: float, error: str | None, attempt: int) -> None:
        if self.metrics is not None:
            self.metrics.labels(self.metrics.relay_calls, result="ok" if ok else "error").inc()
        if self.events is not None:
            record = {"step": step, "replica": replica.url, "ok": ok, "seconds": seconds, "attempt": attempt}
            if error:
                record["error"] = error
            self.events.append(record)
