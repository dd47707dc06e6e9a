"""Evaluation during training: `TrainingEval` evaluates each due weights version in the background.

The orchestrator service starts it: every `eval.interval` versions (an entry's own interval where it sets one, and
version 0 at start) it evaluates the policy through `gyre_orchestrator.evaluate.evaluate_envs` and records the result
in eval.jsonl, W&B and metrics. Its own module, apart from the evaluation itself: it is the training run's scheduling
of evals (a queue fed by the relay's versions, a failure logged and never fatal), which `gyre eval` has no part of.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from gyre.envs import Environment

from gyre_orchestrator.evaluate import EvalResult, eval_plan, eval_tasks, evaluate_envs, mix_record, mix_shares

log = logging.getLogger(__name__)


class TrainingEval:
    """Evaluation during training: each due version (a multiple of `eval.interval`, up to `max_steps`) is
    evaluated once, in the background, through `client.for_version(version)`; results go to eval.jsonl, W&B
    and metrics. A failed evaluation is logged and never stops training."""

    def __init__(self, cfg, envs: Environment | dict[str, Environment], client, *, events, wandb, metrics):
        self.cfg = cfg
        # label -> environment (a mix's entries; one environment alone is its config's)
        envs = envs if isinstance(envs, dict) else {cfg.envs[0].key: envs}
        # the entries evaluated (eval.enabled), each with its number of tasks
        self.plan = eval_plan(cfg, warn=cfg.eval.interval is not None)  # said once, at start (evals on)
        self.envs = {label: env for label, env in envs.items() if label in self.plan}
        self.client = client
        self.events = events
        self.wandb = wandb
        self.metrics = metrics
        self._queue: asyncio.Queue[int] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._evaluated: set[int] = set()
        if cfg.eval.interval is not None:  # at start: a split that cannot be drawn failed every eval, logged only
            for label, env in self.envs.items():
                eval_tasks(env, self.plan[label].num_examples, label, self.plan[label].key)

    def start(self, versions, *, at_start: bool, done: Iterable[int] = ()) -> None:
        """Evaluate each due version that `versions` (a `VersionWatch`) reaches; with `at_start`, version 0 first.

        `done`: versions already evaluated (a restarted orchestrator's eval.jsonl). The version the replicas serve
        now is due too: the relay reached it before this start, and a restart in the middle of its eval (or before
        it) skipped it for good, since the listener only hears of newer versions."""
        self._evaluated.update(done)
        versions.add_listener(self.maybe_queue)
        if at_start and 0 not in self._evaluated:
            self._evaluated.add(0)
            self._queue.put_nowait(0)
        self.maybe_queue(versions.value)
        self._task = asyncio.create_task(self._loop(), name="eval")

    async def finish(self, version: int) -> None:
        """An evaluation that is due (e.g. of the final version) finishes before we exit."""
        if self._task is not None:
            self.maybe_queue(version)
            await self._queue.join()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def maybe_queue(self, version: int) -> None:
        """Queue the newest multiple of each entry's interval that `version` reached (not evaluated yet); at a
        version queued, the entries whose interval it is a multiple of are evaluated (`due_at`)."""
        if self.cfg.eval.interval is None:
            return
        for due in sorted({version - version % entry.interval for entry in self.plan.values()}):
            limit = self.cfg.max_steps if self.cfg.max_steps is not None else due
            if 0 < due <= limit and due not in self._evaluated:
                self._evaluated.add(due)
                self._queue.put_nowait(due)

    def due_at(self, version: int) -> dict[str, Environment]:
        """The entries evaluated at `version`: every one at 0 (the start), else those it is a multiple of the
        interval of (an entry's own eval.interval, else the orchestrator's)."""
        return {label: env for label, env in self.envs.items()
                if version == 0 or version % self.plan[label].interval == 0}  # fmt: skip

    async def _loop(self) -> None:
        cfg = self.cfg
        while True:
            version = await self._queue.get()
            try:
                results = await evaluate_envs(
                    self.due_at(version),
                    # as the newest batch version `version` may generate (its floor): behind the older batches
                    self.client.for_version(version, priority=version + 1 + cfg.max_async_level),
                    self.plan,
                    pass_threshold=cfg.eval.pass_threshold,
                    attempts=cfg.sample_attempts,
                    min_version=version,
                    on_scoring_failure=self._scoring_failed,
                )
                self._record(version, results)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # an eval failure must not lose training progress
                log.error("evaluation of version %d failed: %s", version, e)
            finally:
                self._queue.task_done()

    def _scoring_failed(self, label: str) -> None:
        self.metrics.labels(self.metrics.eval_scoring_failures, env=label).inc()

    def _record(self, version: int, results: dict[str, EvalResult]) -> None:
        record = mix_record(results, mix_shares(self.cfg), version)
        self.events.append(record)
        # W&B takes flat numbers: a mix's entries as eval/<label>/<key>, logged with eval/step (a curve per entry)
        entries = {f"{label}/{k}": v for label, entry in record.get("envs", {}).items() for k, v in entry.items()}
        self.wandb.log({**record, **entries}, prefix="eval")
        m = self.metrics
        for label, result in results.items():
            m.labels(m.eval_reward, env=label, stat="avg_at_k").set(result.avg_at_k)
            m.labels(m.eval_reward, env=label, stat="pass_at_k").set(result.pass_at_k)
        k = record["k"] or "k"  # None: the entries' k differ
        log.info(
            "eval of version %d: avg@%s %.3f, pass@%s %.3f%s",
            version,
            k,
            record["avg_at_k"],
            k,
            record["pass_at_k"],
            "".join(f", {label} {r.avg_at_k:.3f}" for label, r in results.items()) if len(results) > 1 else "",
        )
