"""Where a (re)started orchestrator resumes, and a rewind (`resume_step = N`) made safe.

The resume rule itself is `progress.resume_point`, a pure function of the run's state; this module reads that state
(the trainer's committed step, the batches still in the Redis stream, the task positions of the newest batch) and
does what a rewind needs before the first rollout:

1. `settled_resume_step`, at construction: a restarted pod that already rewound goes on instead of rewinding
   again; a rewind to a step without a progress checkpoint, or a resume under another `seed` or `env` than the
   run's checkpoints were made with, is refused naming the key, before anything changes;
2. `await_trainer_rewind`: the relay waits until the trainer has deleted the abandoned weights versions;
3. `find_resume_point`: the stream's entries after the rewind step and the abandoned progress checkpoints go, the
   resume point is computed, and batches after a gap (regenerated) are deleted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gyre.codec import CodecError
from gyre.config.orchestrator import OrchestratorConfig
from gyre.config.rerun import env_changes
from gyre.runstate import committed_step, mark_rewound, pending_rewind
from gyre.streams import BatchStream

from gyre_orchestrator.progress import ProgressError, ProgressStore, ResumePoint, resume_point

log = logging.getLogger(__name__)

# a rewinding orchestrator waits this long for the trainer to delete the abandoned weights versions (it does so when
# it starts, after loading the model): long enough for a large model, short enough for a trainer that never will
REWIND_WAIT_S = 600.0

#: a Redis call that survives an outage (`OrchestratorService._redis`): (operation, what it is for) -> its result
RedisCall = Callable[[Callable[[], Any], str], Awaitable[Any]]


def settled_resume_step(cfg: OrchestratorConfig, progress: ProgressStore) -> OrchestratorConfig:
    """`cfg` with the `resume_step` this start honours: a rewind already done (a restarted pod) is not done again.
    ValueError naming the key for a rewind to a step without a progress checkpoint, or a run whose checkpoints were
    made with another `seed` or `env` (`refuse_other_tasks`)."""
    if (rewind := pending_rewind(progress.root, cfg.resume_step)) != cfg.resume_step:
        log.info("resume_step = %d: rewound to it before (a restarted pod); resuming where the run stands",
                 cfg.resume_step)  # fmt: skip
        cfg = cfg.model_copy(update={"resume_step": rewind})
    if cfg.resume_step is not None and cfg.resume_step > 0 and cfg.resume_step not in progress.steps():
        # before anything changes: a rewind deletes the stream's batches after the step and waits for the trainer
        raise ValueError(
            f"resume_step: no orchestrator progress checkpoint of step {cfg.resume_step} in {progress.root} "
            f"(have {progress.steps()}; ckpt_interval writes them)"
        )
    refuse_other_tasks(cfg, progress)
    return cfg


def refuse_other_tasks(cfg: OrchestratorConfig, progress: ProgressStore) -> None:
    """ValueError naming the key when the progress checkpoint this orchestrator would resume from was made with
    another task sampler `seed` or environment (`env`, the leaves a started run cannot absorb:
    `gyre.config.rerun.env_changes`). Its task positions index into the first seed's and environment's tasks: a
    `helm upgrade` that changed them went on at the same index of other tasks (rows repeated or skipped mid-run),
    and the stream's batches were of the first environment. `gyre rl` refuses such a re-run before starting;
    this is the check for a restarted pod, which no launcher sees. A rewind to 0 starts the run over: free."""
    if cfg.resume_step == 0 or not progress.steps():
        return
    try:
        saved = progress.load(cfg.resume_step if cfg.resume_step is not None and cfg.resume_step > 0 else -1)
    except ProgressError:
        return  # an unreadable checkpoint: the resume rule says so
    where = f"the run's progress checkpoint {progress.path(saved.step)} (step {saved.step})"
    way_out = ("keep it, rewind to step 0 together with the trainer (resume_step = 0, trainer ckpt.resume_step = "
               "0), or start a new run (another run_id and output folder)")  # fmt: skip
    if saved.seed is not None and saved.seed != cfg.seed:
        raise ValueError(
            f"seed: {where} was made with seed = {saved.seed}, this orchestrator has seed = {cfg.seed}; its task "
            f"position is an index into the first seed's tasks (a new seed repeats or skips tasks): {way_out}"
        )
    if saved.env is not None and (changed := env_changes(saved.env, cfg.model_dump(mode="json")["env"])):
        leaf, was, new = changed[0]
        raise ValueError(
            f"env{leaf}: {where} was made with env{leaf} = {was!r}, this orchestrator has {new!r}; its task "
            f"position and the stream's batches belong to the first environment: {way_out}"
        )


async def await_trainer_rewind(transport: Any, step: int, poll_s: float = 0.5, remind_s: float = 30.0) -> None:
    """A rewind to `step` abandons the weights versions after it, which the trainer deletes as it starts with the
    same `ckpt.resume_step`. Until then they look published: the relay would put the newest on the replicas, and
    its rollouts, the abandoned policy's, would fill the rewound run's first batches (a trainer loading a large
    model deletes them long after an orchestrator has started). So the relay starts once the trainer has deleted
    them, or after `REWIND_WAIT_S` (a trainer that was not rewound: the run goes on as without this wait).
    `transport`: the run's weight store (its `latest()` published version)."""
    abandoned = transport.latest()
    if abandoned is None or abandoned <= step:
        return
    start = last_note = time.monotonic()
    log.warning("rewind to step %d: waiting for the trainer (ckpt.resume_step = %d) to delete the abandoned "
                "weights versions %d..%d before relaying any", step, step, step + 1, abandoned)  # fmt: skip
    while (latest := transport.latest()) is not None and latest >= abandoned:
        now = time.monotonic()
        if now - start >= REWIND_WAIT_S:
            log.warning("rewind to step %d: the trainer still publishes weights versions up to %d after %.0fs "
                        "(was it started with ckpt.resume_step = %d?); going on", step, latest, now - start,
                        step)  # fmt: skip
            return
        if now - last_note >= remind_s:
            last_note = now
            log.warning("rewind to step %d: still waiting for the trainer to delete weights versions %d..%d",
                        step, step + 1, latest)  # fmt: skip
        await asyncio.sleep(poll_s)
    log.info("rewind to step %d: the trainer deleted the abandoned weights versions; relaying", step)


async def find_resume_point(cfg: OrchestratorConfig, out: Path, progress: ProgressStore, transport: Any,
                            stream: BatchStream, redis: RedisCall) -> ResumePoint:  # fmt: skip
    """The step this orchestrator starts at and its task positions (`progress.resume_point`), after a rewind's
    deletions; batches after a gap in the stream are deleted (their steps are generated again)."""
    if cfg.resume_step is not None and cfg.resume_step >= 0:
        dropped = await redis(lambda: stream.discard_after(cfg.resume_step), "discarding rewound batches")
        if dropped:
            log.warning("rewind to step %d: deleted stream entries of steps %s", cfg.resume_step, dropped)
        # the abandoned future's progress checkpoints: left, they were the newest, so retention deleted the
        # rewound run's own as it wrote them, and a restart resumed from the abandoned task position
        abandoned = progress.entries.discard_after(cfg.resume_step)
        if abandoned:
            log.warning("rewind to step %d: deleted progress checkpoints %s", cfg.resume_step, abandoned)
    committed = committed_step(out, transport.latest())
    pending = await redis(lambda: stream.steps_after(committed), "reading the stream")
    cursors, draws = await redis(lambda: stream_positions(stream, cfg.envs[0].key), "reading the newest batch")
    # task_index: the first entry's (the only one's) cursor, as a progress checkpoint holds it
    point = resume_point(cfg.resume_step, progress, committed, pending, cursors.get(cfg.envs[0].key),
                         cursors=cursors, stream_draws=draws)  # fmt: skip
    if cfg.resume_step is not None and cfg.resume_step >= 0:
        mark_rewound(progress.root, cfg.resume_step)  # done: a restart with the same resume_step goes on
    if any(step >= point.start_step for step in pending):
        # batches after a gap (a step the trainer dead-lettered, or that Redis lost): their steps are generated
        # and pushed again, so they go now. Left in place, the trainer trained them (the oldest entry of a step
        # wins) while this run's event log and rollout dumps describe the batches pushed again.
        dropped = await redis(lambda: stream.discard_after(point.start_step - 1), "discarding batches after a gap")
        log.warning("deleted the stream entries of steps %s after the missing step %d: they are generated again",
                    dropped, point.start_step)  # fmt: skip
    return point


def stream_positions(stream: BatchStream, first_label: str) -> tuple[dict[str, int], int | None]:
    """Per entry one past the highest train task index in the newest batch of the stream, and one past its
    highest draw (({}, None) if unknown). `first_label`: the entry a batch from before mixes names by the one
    environment's name, which is its label."""
    newest = stream.newest()
    if newest is None:
        return {}, None
    try:
        batch = newest.decode()
    except CodecError as e:
        log.warning("cannot read the newest batch in the stream (%s); task positions from the checkpoint", e)
        return {}, None
    cursors: dict[str, int] = {}
    draws = None
    for s in batch.samples:
        index, draw = s.get("task_index"), s.get("draw")
        if isinstance(index, int):
            label = str(s.get("env", first_label))
            cursors[label] = max(cursors.get(label, 0), index + 1)
        if isinstance(draw, int):
            draws = max(draws or 0, draw + 1)
    return cursors, draws
