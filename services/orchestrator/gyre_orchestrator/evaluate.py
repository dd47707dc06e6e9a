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

During training `TrainingEval` (`gyre_orchestrator.training_eval`) runs it in the background every
`eval.interval` weights versions (and at start); `gyre eval` (`gyre_orchestrator.eval_command`) runs it once against
whatever the replicas serve and appends the result to `{output_dir}/events/eval.jsonl`:

    gyre eval --env.name reverse_text --inference.urls '["http://127.0.0.1:8000"]' --eval.num-examples 16
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from gyre.config.orchestrator import template_kwargs
from gyre.envs import ContextLengthExceeded, Environment, SamplingParams, Task
from gyre.envs.types import ModelClient

log = logging.getLogger(__name__)


# answers from an older version than the one evaluated, in a row for one sample, before the eval gives up: a replica
# restarted on older weights leaves rotation at the relay's next probe, seconds later
STALE_LIMIT = 20


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
