"""Evaluation on an environment's held-out split: avg@k and pass@k.

For each of the first `num_examples` eval tasks, `k` rollouts are sampled and scored:
- `avg@k`  = mean reward over all `num_examples * k` samples;
- `avg@k stderr` = standard error of that mean with tasks as the unit (sample std of the per-task means over
  sqrt(num_examples)), so two evals on the same split compare with their noise in view;
- `pass@k` = fraction of tasks with at least one sample whose reward is >= `pass_threshold` (within 1e-9: a
  rubric's weighted sum rounds; with exactly k samples per task this is the unbiased pass@k estimator's n = k case);
- `rewards_mean` = each reward function's mean over all samples, unweighted (a weight-0 judge, a monitor, shows
  here and nowhere else in the eval).

A task whose prompt does not fit the model's context is left out of every figure and counted (`skipped_overlong`;
`num_examples` counts the tasks evaluated); only an eval with no task that fits fails.

A sample whose episode failed (the environment raised: `Rollout.error`; inference failed after the client's retries)
is generated again, up to `attempts` times, as in training; the failed attempts are counted (`failed_rollouts`).
Then the eval fails (`EvalFailed`) rather than score half an episode into avg@k. A sample whose judge or reward
model failed is scored again, the same completion (`gyre_orchestrator.rescoring`), up to `attempts` times; then the
eval fails (`ScoringFailed`): a completion a judge failed on left out of avg@k would bias it. Each failed scoring is
counted (`scoring_failures`, and `on_scoring_failure` hears of it: in training
`gyre_orchestrator_eval_scoring_failures_total`), as training's are.
A sample older than the version evaluated (`min_version`: a replica restarted on older weights answered before the
relay knew) is generated again, like a stale training sample, and counted (`dropped_stale`).

A mix (`[[orchestrator.env]]` entries) evaluates every entry on its own held-out split, each with its own rubric; its
`eval.jsonl` line (one per version, as for one environment) holds each entry's result under `envs` (by label) and,
at the top, avg@k and pass@k as the ratio-weighted mean of the entries' (the mix training optimises), counts summed.

During training `TrainingEval` runs it in the background every `eval.interval` weights versions (and at
start); `gyre eval` runs it once against whatever the replicas serve and appends the result to
`{output_dir}/events/eval.jsonl`:

    gyre eval --env.name reverse_text --inference.urls '["http://127.0.0.1:8000"]' --eval.num-examples 16
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import TextIO

from gyre.config.loader import reveal
from gyre.config.orchestrator import template_kwargs
from gyre.endpoint import READY_LOG_S, READY_POLL_S
from gyre.envs import ContextLengthExceeded, Environment, SamplingParams, Task
from gyre.envs.types import ModelClient

log = logging.getLogger(__name__)


# answers from an older version than the one evaluated, in a row for one sample, before the eval gives up: a replica
# restarted on older weights leaves rotation at the relay's next probe, seconds later
STALE_LIMIT = 20
#: `gyre eval`'s bound on one `/v1/models` question while waiting for the policy's server (a frozen one never answers)
READY_PROBE_S = 10.0


class EvalFailed(RuntimeError):
    """A sample of the evaluation failed every attempt."""


@dataclass
class EvalResult:
    env: str
    avg_at_k: float
    pass_at_k: float
    k: int
    num_examples: int
    min_version: int
    max_version: int
    seconds: float
    avg_at_k_stderr: float = 0.0
    rewards_mean: dict[str, float] = field(default_factory=dict)
    reward_errors: dict[str, int] = field(default_factory=dict)  # samples each reward function raised on (scored 0)
    skipped_overlong: int = 0  # tasks left out: their prompt does not fit the model's context
    failed_rollouts: int = 0  # attempts that failed (environment or inference error) and were generated again
    dropped_stale: int = 0  # samples from a version older than the one evaluated, generated again
    scoring_failures: int = 0  # scorings that failed (a judge or reward model after its retries), scored again

    def record(self, step: int) -> dict:
        """The `eval.jsonl` line (docs/architecture.md, "Event logs") plus version/timing extras."""
        return {"step": step, **asdict(self)}


def mix_record(results: dict[str, EvalResult], shares: dict[str, float], step: int) -> dict:
    """The `eval.jsonl` line of a version: one environment's result, or a mix's (its entries under `envs`, by label;
    avg@k, pass@k and their stderr weighted by the entries' shares, counts summed)."""
    if len(results) == 1:
        return next(iter(results.values())).record(step)
    parts = list(results.values())
    # the entries evaluated at this version (each entry's own eval.interval): their weights renormalised to sum to 1
    total = sum(shares[label] for label in results)
    shares = {label: shares[label] / total for label in results}

    def weighted(name: str) -> float:
        return sum(shares[label] * getattr(result, name) for label, result in results.items())

    return {
        "step": step,
        "env": ",".join(results),
        "avg_at_k": weighted("avg_at_k"),
        "pass_at_k": weighted("pass_at_k"),
        # entries evaluated with different k (an entry's own eval.k): no one k for the weighted pass@k
        "k": parts[0].k if len({r.k for r in parts}) == 1 else None,
        "num_examples": sum(r.num_examples for r in parts),
        "min_version": min(r.min_version for r in parts),
        "max_version": max(r.max_version for r in parts),
        "seconds": max(r.seconds for r in parts),  # evaluated side by side
        # independent entries: the weighted sum's variance is the sum of the weighted variances
        "avg_at_k_stderr": math.sqrt(sum((shares[label] * r.avg_at_k_stderr) ** 2 for label, r in results.items())),
        "skipped_overlong": sum(r.skipped_overlong for r in parts),
        "failed_rollouts": sum(r.failed_rollouts for r in parts),
        "dropped_stale": sum(r.dropped_stale for r in parts),
        "scoring_failures": sum(r.scoring_failures for r in parts),
        "envs": {label: asdict(result) for label, result in results.items()},
    }


async def evaluate_envs(
    envs: dict[str, Environment], client: ModelClient, plan: dict[str, EntryEval], **kwargs
) -> dict[str, EvalResult]:
    """`evaluate` of each environment (label -> its result) as `plan` says (`eval_plan`), side by side; the first
    failure fails them all."""
    runs = {label: asyncio.ensure_future(evaluate(env, client, env_name=label, num_examples=plan[label].num_examples,
                                                  k=plan[label].k, sampling=plan[label].sampling,
                                                  length_key=plan[label].length_key, **kwargs))
            for label, env in envs.items()}  # fmt: skip
    try:
        await asyncio.gather(*runs.values())
    except BaseException:
        for run in runs.values():
            run.cancel()
        await asyncio.gather(*runs.values(), return_exceptions=True)
        raise
    return {label: run.result() for label, run in runs.items()}


def mix_shares(cfg) -> dict[str, float]:
    """Each evaluated entry's share of the mix: ratio / sum of the evaluated entries' ratios (an entry with
    eval.enabled = false has no result, and the others' weighted mean still sums their weights to 1)."""
    evaluated = [entry for entry in cfg.envs if entry.eval.enabled]
    total = sum(entry.ratio for entry in evaluated)
    return {entry.key: entry.ratio / total for entry in evaluated}


@dataclass(frozen=True)
class EntryEval:
    """How one entry is evaluated: its tasks per eval (and the key that set them, for errors), samples per task and
    their sampling settings."""

    num_examples: int
    key: str
    k: int
    interval: int | None = None  # evaluated at the multiples of it (None: the orchestrator's eval.interval)
    sampling: SamplingParams = SamplingParams(temperature=0.0)
    length_key: str = "sampling.max_tokens"  # the key that set sampling.max_tokens, for errors


def eval_plan(cfg, *, warn: bool = False) -> dict[str, EntryEval]:
    """Label -> `EntryEval` of each entry evaluated (`eval.enabled`), PRIME-RL's per-environment eval settings: its
    own `eval.num_examples`, `eval.k`, `eval.interval`, `eval.temperature` and `eval.max_tokens`, else the
    orchestrator's. With `warn`, an entry evaluated greedily with k > 1 is logged (the caller's start)."""
    plan = {}
    for i, entry in enumerate(cfg.envs):
        if entry.eval.enabled:
            where = "env" if not isinstance(cfg.env, list) else f"env.{i}"
            own = entry.eval.num_examples is not None
            key = f"{where}.eval.num_examples" if own else "eval.num_examples"
            count = entry.eval.num_examples if own else cfg.eval.num_examples
            interval = entry.eval.interval or getattr(cfg.eval, "interval", None)  # gyre eval's has none
            # the key that set its eval length, for errors: its eval.max_tokens, its training one, the orchestrator's
            length = (f"{where}.eval.max_tokens" if entry.eval.max_tokens is not None else
                      f"{where}.sampling.max_tokens" if entry.sampling.max_tokens is not None else
                      "sampling.max_tokens")  # fmt: skip
            plan[entry.key] = EntryEval(count, key, entry.eval.k or cfg.eval.k, interval, eval_sampling(cfg, entry),
                                        length)  # fmt: skip
            k = plan[entry.key].k
            if warn and k > 1 and plan[entry.key].sampling.temperature == 0:
                # greedy answers to one prompt are one answer k times: pass@k is pass@1, at k times its cost
                k_key = f"{where}.eval.k" if entry.eval.k else "eval.k"
                t_key = f"{where}.eval.temperature" if entry.eval.temperature is not None else "eval.temperature"
                log.warning("%s = %d at %s = 0 (greedy): the %d samples of a task are one answer, so avg@%d and "
                            "pass@%d measure what k = 1 does, at %d times its cost; set %s > 0 for pass@k of sampled "
                            "answers, or %s = 1", k_key, k, t_key, k, k, k, k, t_key, k_key)  # fmt: skip
    return plan


def eval_tasks(env: Environment, num_examples: int, env_name: str, key: str = "eval.num_examples") -> list[Task]:
    """The first `num_examples` tasks of `env`'s eval split (all of them when it holds fewer). ValueError naming the
    settings (`key`: the one that set num_examples) when there are none or they cannot be drawn: `gyre eval` and
    the orchestrator ask before they connect anywhere (it was a traceback after the inference wait, or, in
    training, an error logged at every eval)."""
    where = f"env {env_name!r}, {key} = {num_examples}"
    try:
        source = env.tasks("eval")
        count = min(num_examples, source.size) if source.size is not None else num_examples
        tasks = [source[i] for i in range(count)]
    except Exception as e:  # the environment's own draw: distinct_tasks' ValueError, an IndexError, a dataset's
        raise ValueError(f"{where}: cannot draw the eval tasks: {e}") from e
    if not tasks:
        raise ValueError(f"{where}: the eval split is empty, nothing to evaluate (give the environment eval tasks "
                         "in env.args, e.g. num_eval or an eval split)")  # fmt: skip
    return tasks


async def evaluate(
    env: Environment,
    client: ModelClient,
    *,
    env_name: str,
    num_examples: int,
    k: int,
    sampling: SamplingParams,
    length_key: str = "sampling.max_tokens",
    pass_threshold: float = 1.0,
    progress: Callable[[int, int], None] | None = None,
    attempts: int = 3,
    min_version: int = 0,
    on_scoring_failure: Callable[[str], None] = lambda _env: None,
) -> EvalResult:
    """Evaluate `client`'s policy on the first `num_examples` eval tasks (fewer if the split is smaller); a sample
    that fails is generated again up to `attempts` times, then `EvalFailed`; one from a version below `min_version`
    (the version evaluated) is generated again. `on_scoring_failure(env_name)` hears of each failed scoring (the
    training eval's metric), as it happens: an eval that then fails counts them too.

    `progress(done, total)` is called once before the first sample and after each one (`gyre eval`'s bar)."""
    from gyre_orchestrator.client import SetupRefused
    from gyre_orchestrator.rescoring import ScoringFailed, scored_again

    if num_examples < 1 or k < 1 or attempts < 1:
        raise ValueError("num_examples, k and attempts must be >= 1")
    tasks = eval_tasks(env, num_examples, env_name)
    count = len(tasks)
    start = time.monotonic()
    overlong: dict[int, ContextLengthExceeded] = {}  # task index -> why it was left out
    done = 0
    if progress is not None:
        progress(0, count * k)

    def advanced() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, count * k)

    async def attempt(i: int, j: int, retry: int):
        """Sample j of task i, scored; None when it came from a version older than `min_version` (not scored).
        `retry`: the failed attempts before this one."""
        # with a seed, its own one, the same at every version evaluated (common random numbers: the difference
        # between two versions is less noisy than either score); a retry after a failure its own too: with the
        # first attempt's seed a deterministic engine gave the same answer, and the environment failed on it again
        key = ("eval", i, j) if retry == 0 else ("eval", i, j, "retry", retry)
        rollout = await env.rollout(client, tasks[i], sampling.for_request(*key))
        if rollout.error:  # the episode stopped where the environment raised: its score is no policy's
            raise RuntimeError(f"environment error: {rollout.error}")
        if rollout.policy_version_min < min_version:  # a replica restarted on older weights, not yet known as such
            log.debug("eval of version %d: dropped a sample of version %d", min_version, rollout.policy_version_min)
            return None
        # a failed judge or reward model: this completion is scored again, as in training (ScoringFailed ends the
        # eval); generating another left the samples a judge failed on out of the score. One scored inside its
        # episode (verifiers: not `rescorable`) raises at once and is generated again below.
        score = await scored_again(lambda: env.score(tasks[i], rollout), attempts=attempts, on_failure=scoring_failed,
                                   what=f"eval: sample {j} of task {tasks[i].id}")  # fmt: skip
        return rollout, score

    def scoring_failed(_error: BaseException) -> None:  # counted as training's are (they were not counted at all)
        nonlocal scoring_failures
        scoring_failures += 1
        on_scoring_failure(env_name)

    async def one(i: int, j: int):
        nonlocal failed, stale
        tries = olds = 0
        while True:  # left by a scored sample, an overlong task, or EvalFailed
            try:
                scored = await attempt(i, j, tries)
            except ContextLengthExceeded as e:  # the task cannot run on this model: left out, counted
                overlong[i] = e
                advanced()
                return None
            # a refused key or model: every sample would be, not generated again; a completion whose scoring failed
            # on every attempt: generating another would leave it out
            except (SetupRefused, ScoringFailed):
                raise
            except Exception as e:  # as in training: generated again, never scored as half an episode
                failed += 1
                tries += 1
                if tries == attempts:
                    raise EvalFailed(f"eval: sample {j} of task {tasks[i].id} failed {attempts} times: {e}") from e
                log.warning("eval: sample %d of task %s failed (%s); generating it again", j, tasks[i].id, e)
                continue
            if scored is not None:
                rollout, score = scored
                break
            stale += 1  # generated again, as a stale training sample is: no failure
            olds += 1
            if olds == STALE_LIMIT:  # not a restart the relay corrects within seconds: replicas that misreport
                raise EvalFailed(f"eval of version {min_version}: sample {j} of task {tasks[i].id} came from an "
                                 f"older version {olds} times in a row")  # fmt: skip
        advanced()
        for name, message in score.errors.items():  # scored 0, never silently (as in training)
            if name not in reward_errors:
                log.warning("eval: reward function %r failed on task %s and scored 0: %s", name, tasks[i].id, message)
            reward_errors[name] = reward_errors.get(name, 0) + 1
        return score.reward, rollout.policy_version_min, rollout.policy_version_max, score.per_function

    reward_errors: dict[str, int] = {}
    failed = stale = scoring_failures = 0

    samples = [asyncio.ensure_future(one(i, j)) for i in range(count) for j in range(k)]
    try:
        answers = await asyncio.gather(*samples)
    except BaseException:  # a failed (or cancelled) eval stops its other samples: they held the replicas' rows
        for sample in samples:
            sample.cancel()
        await asyncio.gather(*samples, return_exceptions=True)
        raise
    if overlong:
        if len(overlong) == count:
            raise ContextLengthExceeded(
                f"eval: none of the {count} eval tasks fits the model's context (prompt plus {length_key}), "
                f"e.g. {next(iter(overlong.values()))}; shorten the prompts (env.args), lower {length_key} or "
                "serve a longer context (the replicas' max_model_len)"
            )
        log.warning("eval: left out %d of %d tasks too long for the model's context, e.g. %s", len(overlong), count,
                    next(iter(overlong.values())))  # fmt: skip
    results = [answers[i * k + j] for i in range(count) if i not in overlong for j in range(k)]
    skipped, count = len(overlong), count - len(overlong)
    rewards = [r for r, _, _, _ in results]
    names = sorted({name for *_, per_function in results for name in per_function})
    per_task = [rewards[i * k : (i + 1) * k] for i in range(count)]
    task_means = [sum(group) / k for group in per_task]
    return EvalResult(
        env=env_name,
        avg_at_k=sum(rewards) / len(rewards),
        pass_at_k=sum(any(passes(r, pass_threshold) for r in group) for group in per_task) / count,
        k=k,
        num_examples=count,
        min_version=min(v for _, v, _, _ in results),
        max_version=max(v for _, _, v, _ in results),
        seconds=time.monotonic() - start,
        avg_at_k_stderr=statistics.stdev(task_means) / math.sqrt(count) if count > 1 else 0.0,
        rewards_mean={n: statistics.fmean(per.get(n, 0.0) for *_, per in results) for n in names},
        reward_errors=reward_errors,
        skipped_overlong=skipped,
        failed_rollouts=failed,
        dropped_stale=stale,
        scoring_failures=scoring_failures,
    )


#: a reward this close below the threshold still passes: a rubric's weighted sum rounds (0.7 + 0.2 + 0.1 of three
#: perfect scores is 0.9999999999999999, which failed the default threshold 1.0)
PASS_ATOL = 1e-9


def passes(reward: float, threshold: float) -> bool:
    """pass@k's test of one sample: its reward reaches `threshold`, up to floating-point rounding (`PASS_ATOL`)."""
    return reward >= threshold - PASS_ATOL


def eval_sampling(cfg, entry) -> SamplingParams:
    """Eval sampling of `entry` (one of `cfg.envs`): the train sampling settings with the eval temperature, each
    one the entry's own where it sets it (PRIME-RL's eval sources sample by their own settings: a math entry's 512
    tokens beside a short-answer entry's 32). max_tokens: its eval.max_tokens, else its training length (its
    sampling.max_tokens, else the orchestrator's); chat_template_kwargs: as its training rollouts'."""
    temperature = entry.eval.temperature if entry.eval.temperature is not None else cfg.eval.temperature
    return SamplingParams(
        temperature=temperature,
        top_p=cfg.sampling.top_p if temperature > 0 else 1.0,
        max_tokens=entry.eval.max_tokens or entry.sampling.max_tokens or cfg.sampling.max_tokens,
        seed=cfg.sampling.seed,
        chat_template_kwargs=template_kwargs(cfg.sampling, entry),
    )


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


class EvalProgress:
    """`gyre eval`'s progress bar over the samples (tasks x k), on a terminal only: a log file or a pipe gets
    nothing but the final JSON line (a bar redrawn with carriage returns is noise there)."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = sys.stderr if stream is None else stream
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="eval", unit="sample", file=self.stream, dynamic_ncols=True)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


async def wait_for_inference(client, limit_s: float, *, poll_s: float = READY_POLL_S, log_s: float = READY_LOG_S):
    """`gyre eval`'s first step (`inference.startup_timeout_s`): return once a replica answers `/v1/models` (a
    model still loading is waited for), asking every `poll_s` for up to `limit_s`, saying every `log_s` that it
    waits; `InferenceError` past it, and at once for what no wait mends: a 4xx (a key, a URL) or a host name that
    does not resolve. Without it `gyre eval` against a wrong port retried each sample with growing cooldowns,
    logging replica failures for many minutes, and never said what it waited for."""
    import openai
    from gyre.endpoint import describe, unknown_host

    from gyre_orchestrator.client import BadResponse, InferenceError

    start = time.monotonic()
    logged: float | None = None
    reason = "no replica is known yet (inference.urls / discovery)"
    while True:
        for replica in list(client.replicas):
            remaining = limit_s - (time.monotonic() - start)
            sent = client.api_key
            try:
                async with asyncio.timeout(max(min(client.timeout_s, READY_PROBE_S, remaining), 0.1)):
                    await client.served_model(replica)
                    await client.check_model(replica)  # a model it does not serve: every sample a 404
                if logged is not None:
                    log.info("inference is up: %s", replica.url)
                return
            except openai.APIStatusError as e:
                try:
                    if client.rekey(e.status_code, sent):  # a rotated key: asked again (once: then it is the same)
                        continue
                except ValueError as reread:  # the key file can no longer be read
                    raise InferenceError(f"{replica.url}/v1/models refused the request: {e.status_code}; re-reading "
                                         f"the key: {reread}") from None  # fmt: skip
                if e.status_code < 500 and e.status_code not in (408, 409, 429):  # 409: vLLM's model still loading
                    raise InferenceError(f"{replica.url}/v1/models refused the request: {e.status_code} {describe(e)} "
                                         "(check inference.urls, and inference.api_key or api_key_file)"
                                         ) from None  # fmt: skip
                reason = f"{replica.url}: {e.status_code} {describe(e)}"
            except (openai.APIError, BadResponse, TimeoutError, OSError) as e:
                if unknown_host(e):  # a typo: a Service's name resolves before its pods run
                    raise InferenceError(f"{replica.url}: the host name does not resolve (inference.urls)") from None
                reason = f"{replica.url}: {'no answer' if isinstance(e, TimeoutError) else describe(e)}"
        elapsed = time.monotonic() - start
        if elapsed >= limit_s:
            raise InferenceError(f"no replica answered /v1/models within {limit_s:g}s (last: {reason})")
        if logged is None or elapsed - logged >= log_s:
            log.info("%s inference (%s): %.0fs of %gs", "waiting for" if logged is None else "still waiting for",
                     reason, elapsed, limit_s)  # fmt: skip
            logged = elapsed
        await asyncio.sleep(min(poll_s, limit_s - elapsed))


async def _run_once(
    cfg, progress: Callable[[int, int], None] | None = None, envs=None, signals: dict | None = None
) -> dict:
    """One evaluation of every environment of `cfg` (label -> environment in `envs`, loaded when None); returns the
    `eval.jsonl` line it appended."""
    from gyre.config.endpoint import EVAL_STARTUP_TIMEOUT_S
    from gyre.envs import load_environment
    from gyre.envs.judge import add_to_rubric, held_by
    from gyre.events import EVAL, EventLog, events_dir

    from gyre_orchestrator.client import InferenceClient, close_replica_clients
    from gyre_orchestrator.replicas import ReplicaSet, make_discovery

    plan = eval_plan(cfg)
    envs = envs if envs is not None else {e.key: load_environment(e.name, **e.args) for e in cfg.envs
                                          if e.key in plan}  # fmt: skip
    if signals is None:
        signals = {}
        for env in envs.values():  # scored as in training
            signals = add_to_rubric(env, cfg.judges, cfg.reward_models, signals=signals or None)
    # and the judges the environments' own code made (a ported verifiers JudgeRubric's): waited for alike, up to
    # gyre eval's bound as a configured judge without its own startup_timeout_s
    held = held_by(envs, signals)
    for judge in held.values():
        if "startup_timeout_s" not in judge.config.model_fields_set:
            judge.config.startup_timeout_s = EVAL_STARTUP_TIMEOUT_S
    signals = {**signals, **held}
    replicas = ReplicaSet(cooldown_s=cfg.inference.failure_cooldown_s)
    discovery = make_discovery(cfg.inference, replicas)
    await discovery.start()
    client = InferenceClient(
        replicas,
        model=cfg.inference.model,
        api_key=reveal(cfg.inference.api_key),
        reread_key=lambda: cfg.inference.reread_secret("api_key"),  # a Secret rotated in place
        max_concurrency=cfg.inference.max_concurrency,
        timeout_s=cfg.inference.timeout_s,
        retries=cfg.inference.retries,
    )
    try:
        from gyre.endpoint import wait_all_ready

        if cfg.inference.startup_timeout_s:  # the policy's server, then the judges'
            await wait_for_inference(client, cfg.inference.startup_timeout_s)
        await wait_all_ready(signal.endpoint for signal in signals.values())  # a judge still loading its model
        results = await evaluate_envs(
            envs,
            client,
            plan,
            pass_threshold=cfg.eval.pass_threshold,
            progress=progress,
        )
    finally:
        for env in envs.values():
            aclose = getattr(env, "aclose", None)  # environments holding servers (verifiers) release them
            if aclose is not None:
                await aclose()
        for signal in signals.values():
            await signal.aclose()
        await discovery.stop()
        await close_replica_clients(list(replicas))
    record = mix_record(results, mix_shares(cfg), min(r.min_version for r in results.values()))
    with EventLog(events_dir(cfg.output_dir) / EVAL) as events:
        events.append(record)
    return record


def main(argv: list[str]) -> int:
    """`gyre eval`: one evaluation of the served policy; prints the result as JSON."""
    from gyre.config import parse_or_exit
    from gyre.config.orchestrator import GyreEvalConfig
    from gyre.logging import setup_logging

    summary = (
        "Evaluate the served model once on the environment's held-out split (env, inference, eval.*); print avg@k "
        "and pass@k as JSON and append them to {output_dir}/events/eval.jsonl. A progress bar over the samples shows "
        "on a terminal (stderr), nothing else when the output is a log or a pipe."
    )
    cfg = parse_or_exit(GyreEvalConfig, argv, "gyre eval", summary)
    setup_logging(cfg.log.level, cfg.log.file, "eval", cfg.log.format)
    if cfg.log.level != "DEBUG":  # the openai client's HTTP stack logs a line per request at INFO
        logging.getLogger("httpx2").setLevel(logging.WARNING)
    from gyre.endpoint import EndpointError
    from gyre.envs import load_environment

    from gyre_orchestrator.client import InferenceError

    envs = {}
    plan = eval_plan(cfg, warn=True)
    for i, entry in enumerate(cfg.envs):
        key = f"env.{i}" if isinstance(cfg.env, list) else "env"
        if entry.key not in plan:  # eval.enabled = false: not evaluated, not loaded
            continue
        try:  # before anything connects: an unknown name or bad env.args was a traceback (exit 1)
            envs[entry.key] = load_environment(entry.name, **entry.args)
        except Exception as e:  # EnvironmentLoadError, or the environment's own argument checks
            print(f"gyre eval: error: config key '{key}': {e}", file=sys.stderr)
            return 2
    from gyre.envs.judge import add_to_rubric

    from gyre_orchestrator.replicas import ReplicaSet, make_discovery

    try:  # an inference.urls entry that is no URL (vLLM's host:port), a discovery without its name: a traceback
        make_discovery(cfg.inference, ReplicaSet())  # made, not started: nothing connects
    except ValueError as e:
        print(f"gyre eval: error: {e}", file=sys.stderr)
        return 2
    try:  # no eval tasks (an empty split, a num_eval the task space cannot hold): before anything connects
        for label, env in envs.items():
            eval_tasks(env, plan[label].num_examples, label, plan[label].key)
    except ValueError as e:
        print(f"gyre eval: error: {e}", file=sys.stderr)
        return 2
    try:  # a judge's missing API key: one line naming the judge and the setting, as gyre orchestrator (a traceback)
        signals: dict = {}
        for env in envs.values():  # a mix's entries share them
            signals = add_to_rubric(env, cfg.judges, cfg.reward_models, signals=signals or None)
    except ValueError as e:
        print(f"gyre eval: error: {e}", file=sys.stderr)
        return 2
    progress = EvalProgress()  # a long eval showed nothing until its JSON line
    try:
        record = asyncio.run(_run_once(cfg, progress, envs, signals))
    except EndpointError as e:  # a judge or reward model that never came up, or refused the key: one line
        progress.close()
        print(f"gyre eval: error: {e}", file=sys.stderr)
        return 1
    except (InferenceError, ContextLengthExceeded, EvalFailed) as e:  # nothing serves, no task fits, a sample
        # failed every attempt: one line, no traceback; it names the replica (the Python list of inference.urls in
        # front of it said nothing more, and named the default URL under dns or kubernetes discovery)
        progress.close()
        print(f"gyre eval: error: {e}", file=sys.stderr)
        return 1
    finally:
        progress.close()
    print(json.dumps(record))
    return 0
