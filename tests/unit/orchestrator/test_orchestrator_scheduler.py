"""The async bound in a pure asyncio simulation: replicas, a relay and a trainer with varying speeds.

A simulated trainer consumes batches in order, "trains" for a while, then publishes version s, which a
simulated relay rolls out to the replicas one by one. Generation and training times are drawn per
call, in regimes where either side is the bottleneck. Checked for k = 0, 1, 2:
- every sample of batch s comes from versions >= s-1-k (admission), and every group was dispatched
  when some replica served >= s-1-k (dispatch);
- with k >= 1 generation of batch s+1 overlaps training of step s, and the allowance is used;
- a generator that ignores the floor (sloppy routing to lagging replicas) produces stale samples:
  they are dropped, counted and regenerated, and the bound still holds.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass

import pytest
from gyre.envs import ContextLengthExceeded, SamplingParams
from gyre.envs.types import derive_seed
from gyre_orchestrator.scheduler import RolloutKey, RolloutScheduler, VersionWatch

pytestmark = pytest.mark.asyncio

REGIMES = {
    "generation_bound": ((0.002, 0.008), (0.0, 0.002)),  # (generation s, training s)
    "training_bound": ((0.0, 0.002), (0.010, 0.025)),
    "mixed": ((0.0, 0.010), (0.0, 0.015)),
}


@dataclass
class SimSample:
    reward: float
    min_version: int
    max_version: int


class SimCluster:
    def __init__(self, rng: random.Random, replicas: int, gen_s, relay_s: float, honest: bool):
        self.rng = rng
        self.served = [0] * replicas
        self.versions = VersionWatch(0)
        self.gen_s = gen_s
        self.relay_s = relay_s
        self.honest = honest
        self.generated = 0

    async def generate(self, task, floor: int, key) -> SimSample:
        if self.honest:  # what InferenceClient.for_version does: only replicas serving >= floor
            while not [i for i, v in enumerate(self.served) if v >= floor]:
                await self.versions.wait_at_least(floor)
            i = self.rng.choice([i for i, v in enumerate(self.served) if v >= floor])
        else:
            i = self.rng.randrange(len(self.served))
        vmin = self.served[i]
        await asyncio.sleep(self.rng.uniform(*self.gen_s))
        self.generated += 1
        # rewards vary within a group, so no group is zero-signal here
        return SimSample(reward=self.rng.random(), min_version=vmin, max_version=self.served[i])

    async def publish(self, version: int) -> None:
        for i in self.rng.sample(range(len(self.served)), len(self.served)):
            await asyncio.sleep(self.rng.uniform(0, self.relay_s))
            self.served[i] = max(self.served[i], version)  # relays of s and s+1 may interleave
            self.versions.set(max(self.served))


async def simulate(k: int, regime: str, seed: int, honest: bool = True, steps: int = 8):
    rng = random.Random(seed)
    gen_s, train_s = REGIMES[regime]
    cluster = SimCluster(rng, replicas=2, gen_s=gen_s, relay_s=0.004, honest=honest)
    tasks = iter(range(10**6))
    scheduler = RolloutScheduler(
        cluster.generate,
        lambda: next(tasks),
        cluster.versions,
        batch_size=3,
        group_size=2,
        max_async_level=k,
        max_steps=steps,
        max_inflight_groups=6,
    )
    dispatches: list[tuple[int, float]] = []  # (step, time) of each group's start
    original = scheduler._start_group

    def spy(st):
        dispatches.append((st.step, time.monotonic()))
        original(st)

    scheduler._start_group = spy
    batches, training = [], {}
    relays: list[asyncio.Task] = []
    for s in range(1, steps + 1):
        st = await scheduler.next_batch()
        assert st.step == s  # in order, each exactly once
        batches.append(st)
        started = time.monotonic()
        await asyncio.sleep(rng.uniform(*train_s))
        training[s] = (started, time.monotonic())
        relays.append(asyncio.create_task(cluster.publish(s)))
    await asyncio.gather(*relays)
    await scheduler.stop()
    return batches, dispatches, training


@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize("k", [0, 1, 2])
async def test_async_bound_holds(k, regime):
    batches, dispatches, training = await simulate(k, regime, seed=k * 10 + len(regime))
    for st in batches:
        assert len(st.kept) == 3 and all(len(g.samples) == 2 for g in st.kept)
        for group in st.kept:
            assert group.dispatched_version >= st.step - 1 - k, "dispatched before a fresh enough version was served"
            for sample in group.samples:
                assert sample.min_version >= st.step - 1 - k, "admitted a stale sample"
        assert st.dropped_stale == 0  # honest routing never produces stale samples
    if k == 0:
        # strictly on-policy: nothing for batch s+1 starts before step s finished training
        for step, at in dispatches:
            if step >= 2:
                assert at >= training[step - 1][1]


@pytest.mark.parametrize("k", [1, 2])
async def test_generation_overlaps_training(k):
    batches, dispatches, training = await simulate(k, "training_bound", seed=3)
    # groups of batch s started before the trainer finished step s-1 (the opposite of the k=0 check)
    ahead = [s for s, at in dispatches if s - 1 in training and at < training[s - 1][1]]
    assert len(ahead) >= len(training) - 1, "generation waited for training instead of running ahead"
    lags = [(st.step - 1) - smp.min_version for st in batches for g in st.kept for smp in g.samples]
    assert max(lags) == k  # the allowance is used when training is the bottleneck, never exceeded


@pytest.mark.parametrize("k", [0, 1, 2])
async def test_stale_samples_are_dropped_counted_and_regenerated(k, caplog):
    caplog.set_level(logging.INFO, logger="gyre_orchestrator.scheduler")
    batches, _, _ = await simulate(k, "mixed", seed=7, honest=False, steps=10)
    for st in batches:
        assert len(st.kept) == 3
        assert all(smp.min_version >= st.step - 1 - k for g in st.kept for smp in g.samples)
    if k == 0:
        assert sum(st.dropped_stale for st in batches) > 0  # lagging replicas were hit and filtered out
    # counted per step (the "pushed step" line, gyre_orchestrator_dropped_stale_samples_total), never one log line
    # per sample: a large batch under load dropped hundreds a step
    assert not [r for r in caplog.records if "stale sample" in r.getMessage()]


@dataclass
class Fixed:
    reward: float
    min_version: int = 0
    max_version: int | None = None

    def __post_init__(self):
        if self.max_version is None:
            self.max_version = self.min_version


async def test_zero_signal_groups_are_replaced():
    # tasks 0, 2, 4, ... give equal rewards (no signal): each is dropped and replaced by a fresh task
    async def generate(task, floor, key):
        await asyncio.sleep(0)
        return Fixed(reward=0.5 if task % 2 == 0 else random.random())

    tasks = iter(range(1000))
    sched = RolloutScheduler(
        generate, lambda: next(tasks), VersionWatch(0), batch_size=4, group_size=3, max_async_level=1, max_steps=1
    )
    st = await sched.next_batch()
    assert len(st.kept) == 4 and all(g.task % 2 == 1 for g in st.kept)
    assert st.dropped_zero_signal == st.started_groups - 4 >= 1
    assert len(st.all_rewards) == 3 * st.started_groups  # the filtered groups still count as generated
    await sched.stop()


def budget_scheduler(signal_tasks: set[int]) -> RolloutScheduler:
    """batch 2, oversample_limit 2: at most 4 groups per step; only `signal_tasks` give differing rewards."""

    async def generate(task, floor, key):
        await asyncio.sleep(0)
        return Fixed(reward=random.random() if task in signal_tasks else 1.0)

    tasks = iter(range(1000))
    return RolloutScheduler(
        generate,
        lambda: next(tasks),
        VersionWatch(0),
        batch_size=2,
        group_size=2,
        max_async_level=1,
        max_steps=2,
        oversample_limit=2,
        max_inflight_groups=1,
    )


async def test_budget_closes_a_step_short_with_what_it_kept():
    sched = budget_scheduler({1})
    st = await sched.next_batch()
    assert [g.task for g in st.kept] == [1] and not st.zero_signal_batch
    assert st.started_groups == st.generated_groups == 4 and st.dropped_zero_signal == 3
    assert len(st.wasted) == 6  # the dropped groups' samples: what filtering cost
    await sched.stop()


async def test_a_step_without_any_signal_still_closes_within_its_budget():
    # a task the model never solves: generation stops at 2 x batch_size groups, the batch trains on zero
    # advantages (before, the step sampled on, one group at a time, for as long as nothing had signal)
    sched = budget_scheduler(set())
    first = await asyncio.wait_for(sched.next_batch(), timeout=5)
    second = await asyncio.wait_for(sched.next_batch(), timeout=5)
    for st, tasks in ((first, [2, 3]), (second, [6, 7])):
        assert st.zero_signal_batch and st.started_groups == st.generated_groups == 4
        assert [g.task for g in st.kept] == tasks  # its newest batch_size dropped groups
        assert st.dropped_zero_signal == 4 and len(st.wasted) == 8
    await sched.stop()


async def test_failing_rollouts_fail_the_scheduler_loudly():
    async def generate(task, floor, key):
        raise ConnectionError("replica gone")

    sched = RolloutScheduler(
        generate,
        lambda: 0,
        VersionWatch(0),
        batch_size=1,
        group_size=1,
        max_async_level=0,
        max_steps=1,
        sample_attempts=2,
        retry_backoff_s=0.001,
    )
    with pytest.raises(RuntimeError, match="failed 2 times: replica gone"):
        await asyncio.wait_for(sched.next_batch(), timeout=5)
    await sched.stop()


async def test_a_refused_key_or_model_fails_the_run_at_once_not_after_each_rollouts_attempts():
    # a 401/403/404 (SetupRefused) refuses the configuration: every rollout would be refused the same way
    from gyre_orchestrator.client import SetupRefused

    calls = []

    async def generate(task, floor, key):
        calls.append(key)
        raise SetupRefused("http://r:8000 rejected the request: 404 (check inference.model = 'x' and inference.urls)")

    sched = RolloutScheduler(generate, lambda: 0, VersionWatch(0), batch_size=1, group_size=1, max_async_level=0,
                             max_steps=1, sample_attempts=3, retry_backoff_s=0.001)  # fmt: skip
    with pytest.raises(SetupRefused, match=r"404 \(check inference.model"):
        await asyncio.wait_for(sched.next_batch(), timeout=5)
    await sched.stop()
    assert len(calls) == 1


async def test_a_failed_group_stops_its_other_rollouts():
    # audit: gather raised the failure, but the group's other rollouts ran on (retrying against the replicas, out of
    # reach of stop(), which cancels only the group tasks) after the scheduler had failed
    cancelled = asyncio.Event()

    async def generate(task, floor, key):
        if key.index == 0:
            raise ConnectionError("replica gone")
        try:
            await asyncio.sleep(3600)  # a long rollout
        except asyncio.CancelledError:
            cancelled.set()
            raise

    sched = RolloutScheduler(generate, lambda: 0, VersionWatch(0), batch_size=1, group_size=2, max_async_level=0,
                             max_steps=1, sample_attempts=2, retry_backoff_s=0.001)  # fmt: skip
    with pytest.raises(RuntimeError, match="failed 2 times: replica gone"):
        await asyncio.wait_for(sched.next_batch(), timeout=5)
    await asyncio.wait_for(cancelled.wait(), timeout=1)
    await sched.stop()


def overlong_scheduler(fits, calls: list, delay=lambda task: 0.0, **kwargs) -> RolloutScheduler:
    """batch 2, groups of 3, oversample_limit 2; tasks for which `fits(task)` is false are refused by the model
    client as longer than its context (what the client raises on the server's 400 context_length_exceeded), each
    rollout after `delay(task)` seconds."""

    async def generate(task, floor, key):
        calls.append(task)
        await asyncio.sleep(delay(task))
        if not fits(task):
            raise ContextLengthExceeded(f"task {task}: 400 This model's maximum context length is 64 tokens")
        return Fixed(reward=random.random())

    tasks = iter(range(10**6))
    defaults = dict(batch_size=2, group_size=3, max_async_level=1, max_steps=2, oversample_limit=2,
                    retry_backoff_s=0.001)  # fmt: skip
    return RolloutScheduler(generate, lambda: next(tasks), VersionWatch(0), **{**defaults, **kwargs})


async def test_tasks_too_long_for_the_context_are_skipped_counted_and_replaced(caplog):
    # two of every three tasks are too long: each is skipped at its first refusal (never retried), a fresh task
    # takes its place outside the oversampling budget, and the steps fill up. Before, a refused task was retried
    # sample_attempts times and then failed the run.
    calls: list[int] = []
    sched = overlong_scheduler(lambda task: task % 3 == 2, calls, max_inflight_groups=1)
    with caplog.at_level(logging.WARNING):
        steps = [await asyncio.wait_for(sched.next_batch(), timeout=5) for _ in range(2)]
    await sched.stop()
    assert [[g.task for g in st.kept] for st in steps] == [[2, 5], [8, 11]]
    for st in steps:
        assert st.skipped_overlong == 4 and st.failed_rollouts == 0 and not st.zero_signal_batch
        assert st.started_groups == st.generated_groups == 2  # skipped tasks do not spend the budget
    assert sorted(set(calls) - {2, 5, 8, 11}) == [0, 1, 3, 4, 6, 7, 9, 10]
    assert all(calls.count(t) <= 3 for t in calls)  # at most one refusal per rollout of the group: never retried
    warnings = [r.getMessage() for r in caplog.records if "too long for the model's context" in r.getMessage()]
    assert len(warnings) == 1 and "maximum context length is 64" in warnings[0]  # once, with the server's reason


async def test_a_split_whose_tasks_never_fit_stops_the_run_naming_what_to_change():
    calls: list[int] = []
    sched = overlong_scheduler(lambda task: False, calls, max_inflight_groups=4, overlong_window=20)
    with pytest.raises(RuntimeError) as caught:
        await asyncio.wait_for(sched.next_batch(), timeout=5)
    await sched.stop()
    message = str(caught.value)
    assert "last 20 tasks drawn were all too long" in message and "maximum context length is 64" in message
    for key in ("sampling.max_tokens", "max_model_len", "env.args"):
        assert key in message
    assert len(set(calls)) <= 20 + 4  # it stops at the window (plus the groups in flight), not after retries


async def test_a_split_that_never_fits_stops_the_run_while_the_newest_draws_are_in_flight():
    # the server's refusals come one by one, each group's after its own time (HTTP), and every refusal starts a
    # fresh draw: the newest groups are always in flight. They counted as fitting, so the window never held only
    # refusals, and a run whose tasks never fit skipped them for ever (10,000 refusals in 20 s, no step)
    calls: list[int] = []
    sched = overlong_scheduler(lambda task: False, calls, delay=lambda task: 0.001 * (1 + task % 4),
                               max_inflight_groups=8, overlong_window=20)  # fmt: skip
    with pytest.raises(RuntimeError, match="last 20 tasks drawn were all too long"):
        await asyncio.wait_for(sched.next_batch(), timeout=5)
    await sched.stop()
    assert len(set(calls)) <= 20 + 8


async def test_a_task_that_fits_while_it_generates_keeps_the_run_going():
    # 9 of every 10 tasks are refused at once while the ones that fit generate for long: the refusals that finish
    # meanwhile are newer draws than a group still generating, so they do not fill the window before it
    calls: list[int] = []
    sched = overlong_scheduler(lambda task: task % 10 == 9, calls, delay=lambda task: 0.2 if task % 10 == 9 else 0.0,
                               max_inflight_groups=4, overlong_window=20)  # fmt: skip
    steps = [await asyncio.wait_for(sched.next_batch(), timeout=10) for _ in range(2)]
    await sched.stop()
    assert all(len(st.kept) == 2 for st in steps)


async def test_a_task_that_fits_among_the_window_keeps_the_run_going():
    # 19 of every 20 tasks are too long: the window of 20 always holds one that fits, so the run goes on
    sched = overlong_scheduler(lambda task: task % 20 == 19, [], max_inflight_groups=1, overlong_window=20)
    steps = [await asyncio.wait_for(sched.next_batch(), timeout=5) for _ in range(2)]
    await sched.stop()
    assert [[g.task for g in st.kept] for st in steps] == [[19, 39], [59, 79]]
    assert [st.skipped_overlong for st in steps] == [38, 38]


async def test_dispatch_waits_for_the_version():
    versions = VersionWatch(0)
    seen = []

    async def generate(task, floor, key):
        seen.append((floor, versions.value))
        return Fixed(reward=random.random(), min_version=versions.value)

    tasks = iter(range(1000))
    sched = RolloutScheduler(
        generate,
        lambda: next(tasks),
        versions,
        batch_size=1,
        group_size=2,
        max_async_level=0,
        start_step=5,
        max_steps=5,
    )
    sched.start()
    await asyncio.sleep(0.05)
    assert seen == []  # batch 5 with k=0 needs version 4
    versions.set(3)
    await asyncio.sleep(0.05)
    assert seen == []
    versions.set(4)
    st = await asyncio.wait_for(sched.next_batch(), timeout=5)
    assert st.step == 5 and all(v >= 4 for _, v in seen)
    await sched.stop()


async def test_each_rollout_of_a_group_is_named_by_its_step_and_index():
    keys = []

    async def generate(task, floor, key):
        keys.append((task, key))
        return Fixed(reward=random.random())

    tasks = iter(range(1000))
    sched = RolloutScheduler(
        generate, lambda: next(tasks), VersionWatch(0), batch_size=2, group_size=3, max_async_level=0, max_steps=1
    )
    await sched.next_batch()
    assert sorted(keys, key=repr) == sorted(((t, RolloutKey(1, i)) for t in (0, 1) for i in range(3)), key=repr)
    await sched.stop()


async def test_request_seeds_differ_per_key_and_repeat_across_processes():
    base = SamplingParams(seed=7)
    seeds = {base.for_request("train", step, task, i).seed for step in (1, 2) for task in (0, 1) for i in range(4)}
    assert len(seeds) == 16 and all(0 <= s < 2**63 for s in seeds)
    assert base.for_request("train", 1, 0, 0) == base.for_request("train", 1, 0, 0)
    assert base.for_request("train", 1, 0, 0).seed == derive_seed(7, "train", 1, 0, 0) == 2857775692858735553
    assert SamplingParams(seed=None).for_request("train", 1, 0, 0).seed is None  # the server draws one


async def test_a_failed_rollout_is_generated_again_with_a_fresh_seed():
    """With sampling.seed, a retry after a failure asked for the first attempt's seed again: a deterministic engine
    gave the same answer, an environment that broke off on it broke off again, and after sample_attempts the run
    stopped. The scheduler names each retry (`RolloutKey.retry`) and the service derives a seed of its own from it;
    a first attempt keeps its seed (a rerun repeats it)."""
    from types import SimpleNamespace

    from gyre_orchestrator.metrics import OrchestratorMetrics
    from gyre_orchestrator.mix import MixTask
    from gyre_orchestrator.service import OrchestratorService, RolloutFailed

    keys = []

    async def generate(task, floor, key):
        keys.append(key)
        if len(keys) < 3:
            raise RuntimeError("environment error: unparsable answer")
        return Fixed(reward=1.0)

    sched = RolloutScheduler(generate, lambda: 0, VersionWatch(0), batch_size=1, group_size=1, max_async_level=0,
                             max_steps=1, sample_attempts=3, retry_backoff_s=0.001, drop_zero_signal=False)  # fmt: skip
    await asyncio.wait_for(sched.next_batch(), timeout=5)
    await sched.stop()
    assert keys == [RolloutKey(1, 0), RolloutKey(1, 0, 1), RolloutKey(1, 0, 2)]

    seeds = []

    class BrokenEnv:
        async def rollout(self, client, task, sampling):
            seeds.append(sampling.seed)
            return SimpleNamespace(error="env_response failed: ValueError: unparsable answer")

    service = SimpleNamespace(envs={"d": BrokenEnv()}, entry_sampling={"d": SamplingParams(seed=7)},
                              client=SimpleNamespace(for_version=lambda floor, priority: None),
                              metrics=OrchestratorMetrics("t"))  # fmt: skip
    item = MixTask(env="d", index=3, draw=0, task=SimpleNamespace(id="t3"))
    for key in keys:
        with pytest.raises(RolloutFailed, match="unparsable answer"):
            await OrchestratorService._generate(service, item, 0, key)
    assert seeds[0] == derive_seed(7, "train", 1, 3, 0)  # as before: a rerun repeats its first attempts
    assert len(set(seeds)) == 3


async def test_a_sample_from_a_version_its_batch_cannot_come_from_is_dropped_and_generated_again():
    """Batch s trains version s, so while the trainer has not trained step s, a sample of version >= s is from
    weights that are no ancestor of the run's policy: a version the trainer rewound away from (the relay set it
    on the replicas before the restarted trainer deleted it, and rolls it back only later) or another run's
    weights still on a replica. The floor alone admitted it (version 7 >= floor 2): batch 3 of a run rewound to
    step 2 trained on rollouts of the abandoned version 7."""
    served = [7, 7, 2, 2]  # what the replica serves at each request: the abandoned 7, then the rollback to 2

    async def generate(task, floor, key):
        return Fixed(reward=random.random(), min_version=served.pop(0) if served else 2)

    tasks = iter(range(1000))
    sched = RolloutScheduler(
        generate, lambda: next(tasks), VersionWatch(7), batch_size=1, group_size=2, max_async_level=0,
        start_step=3, max_steps=3, trained=lambda: 2,
    )  # fmt: skip
    st = await asyncio.wait_for(sched.next_batch(), timeout=5)
    assert [(smp.min_version, smp.max_version) for smp in st.samples] == [(2, 2), (2, 2)]
    assert st.dropped_stale == 2 and [smp.max_version for smp in st.wasted] == [7, 7]
    await sched.stop()


async def test_a_batch_the_trainer_already_trained_takes_samples_of_its_version():
    """Redis lost batch 3 while the trainer was training it: the orchestrator generates it again and the trainer
    publishes version 3 meanwhile. The batch is a replay the trainer skips; refusing version 3 would regenerate
    its samples forever."""

    async def generate(task, floor, key):
        return Fixed(reward=random.random(), min_version=3)

    tasks = iter(range(1000))
    sched = RolloutScheduler(
        generate, lambda: next(tasks), VersionWatch(3), batch_size=1, group_size=2, max_async_level=0,
        start_step=3, max_steps=3, trained=lambda: 3,
    )  # fmt: skip
    st = await asyncio.wait_for(sched.next_batch(), timeout=5)
    assert st.dropped_stale == 0 and [smp.min_version for smp in st.samples] == [3, 3]
    await sched.stop()


async def test_an_environment_of_a_mix_whose_tasks_never_fit_stops_the_run_naming_it():
    # one entry of a mix whose prompts never fit: the other's tasks in the window kept the run going, so that entry
    # was silently left out of the mix (its ratio, in effect, 0)
    from gyre_orchestrator.mix import MixTask

    numbers = iter(range(10**6))

    def next_task():
        n = next(numbers)
        return MixTask(env="long" if n % 2 else "short", index=n // 2, draw=n, task=n)

    async def generate(task, floor, key):
        if task.env == "long":
            raise ContextLengthExceeded(f"task {task.task}: 400 This model's maximum context length is 64 tokens")
        return Fixed(reward=random.random())

    sched = RolloutScheduler(generate, next_task, VersionWatch(0), batch_size=2, group_size=3, max_async_level=100,
                             max_steps=100, max_inflight_groups=1, overlong_window=20,
                             length_keys={"long": "env.1.sampling.max_tokens"})  # fmt: skip
    with pytest.raises(RuntimeError, match="last 20 tasks drawn from environment 'long' were all too long") as error:
        for _ in range(100):
            await asyncio.wait_for(sched.next_batch(), timeout=5)
    await sched.stop()
    # the key that set the entry's length (its own max_tokens), not the orchestrator's it does not read
    assert "prompt plus env.1.sampling.max_tokens" in str(error.value)
    assert "lower env.1.sampling.max_tokens" in str(error.value)


@pytest.mark.parametrize("refill", ["mix", "entry"])
async def test_a_mix_s_dropped_groups_are_refilled_from_the_mix_or_from_their_own_entry(refill):
    """Entry "flat" has equal rewards on its even tasks (dropped), "signal" never. Refilled by fresh draws of the mix
    (the default) the kept groups lean toward "signal"; with refill = "entry" each dropped group is replaced by its
    own entry's next task, outside the draw sequence (draw None), so each entry keeps the groups it was drawn."""
    from gyre_orchestrator.mix import TaskMix

    mix = TaskMix({"flat": range(10**6), "signal": range(10**6)}, {"flat": 1, "signal": 1}, seed=3)

    async def generate(task, floor, key):
        await asyncio.sleep(0)
        return Fixed(reward=0.5 if task.env == "flat" and task.index % 2 == 0 else random.random())

    sched = RolloutScheduler(generate, mix.next, VersionWatch(0), batch_size=8, group_size=2, max_async_level=100,
                             max_steps=4, oversample_limit=4, max_inflight_groups=1,
                             refill_from_entry=refill == "entry")  # fmt: skip
    kept, drawn = {"flat": 0, "signal": 0}, {"flat": 0, "signal": 0}
    for _ in range(4):
        st = await asyncio.wait_for(sched.next_batch(), timeout=10)
        assert len(st.kept) == 8 and st.dropped_zero_signal >= 1
        for group in st.finished:
            if group.task.draw is not None:
                drawn[group.task.env] += 1
        for group in st.kept:
            kept[group.task.env] += 1
    await sched.stop()
    refills = [g.task for g in st.finished if g.task.draw is None]
    if refill == "entry":
        assert kept == drawn  # every entry trained on exactly the groups the ratios drew for it
        assert refills and {t.env for t in refills} == {"flat"}
        assert mix.draws == sum(drawn.values()) == 32  # the draw sequence: the batches' groups, no more
    else:
        assert not refills and kept["signal"] > kept["flat"]  # fresh draws: the kept mix leans toward signal


@pytest.mark.parametrize("inflight", [1, 2, 8])
async def test_an_entry_without_signal_refills_only_after_the_step_s_own_draws(inflight):
    """refill = "entry" with an entry whose groups never carry a signal: its refills spend the step's budget, but
    only once the step's batch_size draws are started. Taken at once (fewer groups in flight than a step holds),
    flat's refills spent the budget before signal's draws were made: the step kept none of them, a batch of
    dropped groups."""
    from gyre_orchestrator.mix import TaskMix

    mix = TaskMix({"flat": range(10**6), "signal": range(10**6)}, {"flat": 1, "signal": 1}, seed=3)
    picks = [mix.pick(n) for n in range(12)]
    assert picks[0] == "flat"  # the step's first draw: its refill would be next in line

    async def generate(task, floor, key):
        await asyncio.sleep(0)
        return Fixed(reward=0.5 if task.env == "flat" else random.random())

    sched = RolloutScheduler(generate, mix.next, VersionWatch(0), batch_size=4, group_size=2, max_async_level=100,
                             max_steps=3, oversample_limit=3, max_inflight_groups=inflight,
                             refill_from_entry=True)  # fmt: skip
    for step in range(3):
        st = await asyncio.wait_for(sched.next_batch(), timeout=10)
        own = [n for n in range(4 * step, 4 * step + 4) if picks[n] == "signal"]
        assert not st.zero_signal_batch and sorted(g.task.draw for g in st.kept) == own
        assert st.generated_groups == 12  # flat's refills spent the rest of the budget
        assert {g.task.env for g in st.finished if g.task.draw is None} == {"flat"}
    await sched.stop()
    assert mix.draws == 12  # the sequence: the steps' own draws, no more


async def test_a_refill_too_long_for_the_context_is_replaced_by_its_own_entry_s_next_task():
    """refill = "entry": flat's groups never carry a signal and its refills of odd tasks do not fit the context.
    Such a refill is skipped and replaced by flat's next task, as the refill it was: a fresh draw took its place
    (the step's share went to the mix, and the draws of the steps after it moved). A skipped draw of the sequence
    is replaced by the next draw, as before."""
    from gyre_orchestrator.mix import TaskMix

    mix = TaskMix({"flat": range(10**6), "signal": range(10**6)}, {"flat": 1, "signal": 1}, seed=3)
    picks = [mix.pick(n) for n in range(12)]

    async def generate(task, floor, key):
        await asyncio.sleep(0)
        if task.draw is None and task.index % 2:  # some of flat's refills (a skipped draw is another's business)
            raise ContextLengthExceeded(f"task {task.index}: 400 This model's maximum context length is 64 tokens")
        return Fixed(reward=0.5 if task.env == "flat" else random.random())

    sched = RolloutScheduler(generate, mix.next, VersionWatch(0), batch_size=4, group_size=2, max_async_level=100,
                             max_steps=3, oversample_limit=3, max_inflight_groups=2,
                             refill_from_entry=True)  # fmt: skip
    for step in range(3):
        st = await asyncio.wait_for(sched.next_batch(), timeout=10)
        own = [n for n in range(4 * step, 4 * step + 4) if picks[n] == "signal"]
        assert sorted(g.task.draw for g in st.kept) == own and st.skipped_overlong > 0
        assert {g.task.env for g in st.finished if g.task.draw is None} == {"flat"}
    await sched.stop()
    assert mix.draws == 12  # every skipped refill was flat's own next task, never a draw of the sequence
