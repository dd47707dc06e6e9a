"""A mix of environments ([[orchestrator.env]]) trained as one policy: real replicas, Redis and stream."""

from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict

import pytest
from gyre.envs import SamplingParams
from gyre.events import latest_per_step, read_events
from gyre.rollouts import read_dump
from gyre.streams import BatchStream
from gyre_orchestrator.mix import TaskMix
from gyre_orchestrator.service import OrchestratorService
from orchestrator_testlib import orchestrator_config

pytestmark = pytest.mark.timeout(300)

MIX = [
    {"name": "reverse_text", "label": "rev", "ratio": 3, "args": {"num_eval": 2}},
    {"name": "arithmetic", "label": "math", "ratio": 1, "args": {"num_eval": 2}},
]


def pushed_samples(redis_url: str, run_id: str) -> list[tuple[int, dict]]:
    stream = BatchStream(redis_url, run_id)
    try:
        return [
            (e.step, s)
            for e in (stream._entry(i, f) for i, f in stream.redis.xrange(stream.key))
            for s in e.decode().samples
        ]
    finally:
        stream.redis.close()


def expected_draws(cfg, count: int) -> list[str]:
    """The entries the draws 0..count-1 pick (a pure function of the seed and the ratios)."""
    mix = TaskMix({e.key: None for e in cfg.envs}, {e.key: e.ratio for e in cfg.envs}, seed=cfg.seed)
    return [mix.pick(n) for n in range(count)]


def mix_config(tmp_path, redis_url, run_id, replicas, **overrides):
    values = {"env": MIX, "batch_size": 4, "rollouts_per_example": 2, "max_async_level": 50, "ckpt_interval": 1,
              "advantage": {"drop_zero_signal": False}, **overrides}  # fmt: skip
    return orchestrator_config(tmp_path, redis_url, run_id, replicas, **values)


@pytest.mark.asyncio
async def test_each_group_comes_from_one_environment_drawn_by_ratio_and_is_reported_per_environment(
    tmp_path, redis_url, unique_run_id, replicas
):
    cfg = mix_config(tmp_path, redis_url, unique_run_id, replicas, max_steps=3,
                     eval={"interval": 100, "num_examples": 2})  # fmt: skip
    service = OrchestratorService(cfg)
    assert await asyncio.wait_for(service.run(), timeout=180) == 0
    samples = pushed_samples(redis_url, unique_run_id)
    # a group (a task and its rollouts) is one environment's, scored by its own rubric
    groups = defaultdict(set)
    for step, s in samples:
        groups[(step, s["group"])].add((s["env"], s["task_index"], s["draw"]))
    assert all(len(members) == 1 for members in groups.values()) and len(groups) == 12
    drawn = sorted(next(iter(m)) for m in groups.values())
    # draw n's entry is the seeded draw's; each entry reads its own split in order, from 0, nothing repeated
    assert [d for _, _, d in sorted(drawn, key=lambda x: x[2])] == list(range(12))
    picks = expected_draws(cfg, 12)
    assert all(picks[draw] == env for env, _, draw in drawn)
    for label in ("rev", "math"):
        assert sorted(i for env, i, _ in drawn if env == label) == list(range(picks.count(label)))
    # the rubric of each: arithmetic's functions score its samples, reverse_text's its own
    assert {name for _, s in samples if s["env"] == "math" for name in s["rewards"]}.isdisjoint(
        {name for _, s in samples if s["env"] == "rev" for name in s["rewards"]}
    )

    # the rollout dump says which entry each sample is of (task ids repeat across environments)
    dumped = sorted((r["env"], r["task_id"], r["group"]) for r in read_dump(cfg.output_dir, 1))
    assert dumped == sorted((s["env"], s["task_id"], s["group"]) for step, s in samples if step == 1)

    lines = latest_per_step(read_events(cfg.output_dir / "events" / "orchestrator_steps.jsonl"))
    totals = {"rev": 0, "math": 0}
    for line in lines:
        assert set(line["envs"]) == {"rev", "math"}
        assert sum(e["num_samples"] for e in line["envs"].values()) == line["num_samples"]
        mine = [s for step, s in samples if step == line["step"]]
        for label, entry in line["envs"].items():
            rewards = [s["reward"] for s in mine if s["env"] == label]
            assert entry["num_samples"] == len(rewards) and entry["num_groups"] == len(rewards) // 2
            if rewards:
                assert entry["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
            totals[label] += len(rewards)
            assert entry["total_samples"] == totals[label]
    assert totals == {label: 2 * picks.count(label) for label in totals}
    # Prometheus: the reward gauges carry each entry's label
    registry = service.metrics.registry
    for label in ("rev", "math"):
        assert registry.get_sample_value("gyre_orchestrator_reward_mean", {"run_id": cfg.run_id, "env": label}) \
            is not None  # fmt: skip

    # each entry's held-out split evaluated and reported by its label; the top line is their ratio-weighted mean
    (evaluation,) = latest_per_step(read_events(cfg.output_dir / "events" / "eval.jsonl"))
    per_env = evaluation["envs"]
    assert set(per_env) == {"rev", "math"} and all(e["num_examples"] == 2 for e in per_env.values())
    assert per_env["rev"]["env"] == "rev"
    assert evaluation["avg_at_k"] == pytest.approx(
        0.75 * per_env["rev"]["avg_at_k"] + 0.25 * per_env["math"]["avg_at_k"]
    )
    for label in ("rev", "math"):
        assert registry.get_sample_value(
            "gyre_orchestrator_eval_reward", {"run_id": cfg.run_id, "env": label, "stat": "avg_at_k"}
        ) == pytest.approx(per_env[label]["avg_at_k"])


@pytest.mark.asyncio
async def test_a_restart_continues_each_environment_s_cursor_and_the_draw_sequence(
    tmp_path, redis_url, unique_run_id, replicas
):
    cfg = mix_config(tmp_path, redis_url, unique_run_id, replicas, max_steps=2)
    assert await asyncio.wait_for(OrchestratorService(cfg).run(), timeout=180) == 0
    resumed = cfg.model_copy(update={"max_steps": 4, "resume_step": -1})
    assert await asyncio.wait_for(OrchestratorService(resumed).run(), timeout=180) == 0
    samples = pushed_samples(redis_url, unique_run_id)
    assert sorted({step for step, _ in samples}) == [1, 2, 3, 4]
    drawn = sorted({(s["draw"], s["env"], s["task_index"]) for _, s in samples})
    # the same sequence as one uninterrupted run: draws 0..15, each picked as the seed says, no task twice
    assert [d for d, _, _ in drawn] == list(range(16))
    picks = expected_draws(cfg, 16)
    assert [env for _, env, _ in drawn] == picks
    for label in ("rev", "math"):
        assert [i for _, env, i in drawn if env == label] == list(range(picks.count(label)))
    # the progress checkpoint holds each entry's cursor and the draw count
    point = OrchestratorService(resumed).progress.load(-1)
    assert (point.cursors, point.draws) == ({label: picks.count(label) for label in ("rev", "math")}, 16)


@pytest.mark.asyncio
async def test_an_entry_s_own_group_size_and_eval_settings(tmp_path, redis_url, unique_run_id, replicas):
    """PRIME-RL's per-environment group size and eval settings: `rev` draws groups of 4 and is evaluated on 3 tasks
    (k = 2),
    `math` groups of 2 (the orchestrator's) and is not evaluated. Each group holds its entry's size, its advantages
    are its own (Dr. GRPO: reward minus its group's mean), the step lines count samples and groups per entry, and a
    restart continues every cursor and the draw sequence."""
    env = [{**MIX[0], "rollouts_per_example": 4, "args": {"num_eval": 3}, "eval": {"num_examples": 3, "k": 2}},
           {**MIX[1], "eval": {"enabled": False}}]  # fmt: skip
    cfg = mix_config(tmp_path, redis_url, unique_run_id, replicas, env=env, max_steps=2,
                     eval={"interval": 100, "num_examples": 2})  # fmt: skip
    assert await asyncio.wait_for(OrchestratorService(cfg).run(), timeout=180) == 0
    resumed = cfg.model_copy(update={"max_steps": 3, "resume_step": -1})
    assert await asyncio.wait_for(OrchestratorService(resumed).run(), timeout=180) == 0

    samples = pushed_samples(redis_url, unique_run_id)
    groups = defaultdict(list)
    for step, s in samples:
        groups[(step, s["group"])].append(s)
    size = {"rev": 4, "math": 2}
    picks = expected_draws(cfg, 12)
    assert sorted(g[0]["draw"] for g in groups.values()) == list(range(12))  # 4 groups a step, whatever their size
    for members in groups.values():
        label = members[0]["env"]
        assert {s["env"] for s in members} == {label} and len(members) == size[label]
        assert picks[members[0]["draw"]] == label
        mean = sum(s["reward"] for s in members) / len(members)
        assert [s["advantage"] for s in members] == pytest.approx([s["reward"] - mean for s in members], abs=1e-6)
    for label in ("rev", "math"):  # each cursor continued across the restart: no task repeated or skipped
        indices = sorted(g[0]["task_index"] for g in groups.values() if g[0]["env"] == label)
        assert indices == list(range(picks.count(label)))

    lines = latest_per_step(read_events(cfg.output_dir / "events" / "orchestrator_steps.jsonl"))
    assert [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:
        mine = [g for (step, _), g in groups.items() if step == line["step"]]
        assert line["num_samples"] == sum(len(g) for g in mine) and line["num_groups"] == len(mine) == 4
        for label, entry in line["envs"].items():
            assert entry["num_groups"] == sum(g[0]["env"] == label for g in mine)
            assert entry["num_samples"] == size[label] * entry["num_groups"]

    # only rev is evaluated, on its own 3 tasks, 2 samples each (the orchestrator's eval: 2 tasks, k = 1)
    (evaluation,) = latest_per_step(read_events(cfg.output_dir / "events" / "eval.jsonl"))
    assert evaluation["env"] == "rev" and evaluation["num_examples"] == 3 and "envs" not in evaluation
    assert evaluation["k"] == 2


def record_rollouts(service: OrchestratorService) -> list[tuple[str, SamplingParams, int]]:
    """(entry, sampling asked, completion tokens the replica returned) of every rollout of `service`, train and
    eval: each entry's environment is wrapped where the scheduler and the evaluations call it."""
    seen = []
    for label, env in service.envs.items():

        async def rollout(client, task, sampling, _label=label, _inner=env.rollout):
            result = await _inner(client, task, sampling)
            seen.append((_label, sampling, sum(result.loss_mask)))
            return result

        env.rollout = rollout
    return seen


@pytest.mark.asyncio
async def test_an_entry_s_own_completion_length_and_eval_sampling(tmp_path, redis_url, unique_run_id, replicas):
    """PRIME-RL's eval sources sample by their own settings: `rev` evaluates at temperature 0.8 with 3 tokens a
    turn and trains with 12; `math` trains with 2 and evaluates greedily (the orchestrator's eval.temperature) at
    its training length. The replicas are asked for, and return, no more than each entry's length."""
    env = [{**MIX[0], "sampling": {"max_tokens": 12}, "eval": {"temperature": 0.8, "max_tokens": 3}},
           {**MIX[1], "sampling": {"max_tokens": 2}}]  # fmt: skip
    cfg = mix_config(tmp_path, redis_url, unique_run_id, replicas, env=env, max_steps=1,
                     eval={"interval": 100, "num_examples": 2})  # fmt: skip
    service = OrchestratorService(cfg)
    seen = record_rollouts(service)
    assert await asyncio.wait_for(service.run(), timeout=180) == 0

    asked = {(label, sampling.temperature, sampling.max_tokens) for label, sampling, _ in seen}
    # training at the orchestrator's temperature (1.0), each entry's own length; evals at each entry's own
    assert asked == {("rev", 1.0, 12), ("math", 1.0, 2), ("rev", 0.8, 3), ("math", 0.0, 2)}
    longest = {key: max(n for label, sampling, n in seen if (label, sampling.temperature, sampling.max_tokens) == key)
               for key in asked}  # fmt: skip
    assert all(n <= key[2] for key, n in longest.items()), longest
    # the trained samples are the lengths generated: math's turns of 2 tokens at most
    samples = pushed_samples(redis_url, unique_run_id)
    assert {s["env"] for _, s in samples} == {"rev", "math"}
    assert all(s["num_loss_tokens"] <= {"rev": 12, "math": 2}[s["env"]] for _, s in samples)
    # Dr. GRPO's normaliser: the longest entry's budget (rev's 12 tokens x 1 turn), not the orchestrator's 16
    stream = BatchStream(redis_url, unique_run_id)
    try:
        (batch,) = [stream._entry(i, f).decode() for i, f in stream.redis.xrange(stream.key)]
    finally:
        stream.redis.close()
    assert batch.max_tokens == 12
    (evaluation,) = latest_per_step(read_events(cfg.output_dir / "events" / "eval.jsonl"))
    assert set(evaluation["envs"]) == {"rev", "math"}


@pytest.mark.asyncio
async def test_refills_from_the_dropped_group_s_entry_and_a_restart_repeats_no_task(
    tmp_path, redis_url, unique_run_id, replicas
):
    """advantage.refill = "entry" with zero-signal filtering on (the tiny model's arithmetic answers mostly score 0:
    its groups are dropped): each replacement is the dropped group's own entry's next task, outside the draw
    sequence (draw null), counted against that entry's dropped groups; a restart continues every cursor, no task
    of an entry used twice."""
    cfg = mix_config(tmp_path, redis_url, unique_run_id, replicas, max_steps=2,
                     advantage={"drop_zero_signal": True, "refill": "entry", "oversample_limit": 3})  # fmt: skip
    assert await asyncio.wait_for(OrchestratorService(cfg).run(), timeout=180) == 0
    resumed = cfg.model_copy(update={"max_steps": 3, "resume_step": -1})
    assert await asyncio.wait_for(OrchestratorService(resumed).run(), timeout=180) == 0
    samples = pushed_samples(redis_url, unique_run_id)
    groups = {(step, s["group"]): s for step, s in samples}
    lines = {line["step"]: line for line in latest_per_step(read_events(cfg.output_dir / "events" /
                                                                        "orchestrator_steps.jsonl"))}  # fmt: skip
    assert sorted(lines) == [1, 2, 3]
    for step, line in lines.items():
        for label, entry in line["envs"].items():
            refills = sum(1 for (st, _), s in groups.items() if st == step and s["env"] == label and s["draw"] is None)
            assert refills <= entry["dropped_zero_signal"]  # a refill stands in for one of its own entry's drops
    for label in ("rev", "math"):
        indices = [s["task_index"] for s in groups.values() if s["env"] == label]
        assert len(indices) == len(set(indices))  # no task of an entry in two groups, across the restart
    draws = [s["draw"] for s in groups.values() if s["draw"] is not None]
    assert len(draws) == len(set(draws))


def flat_reward(completion) -> float:
    """Every sample the same reward: each group of its entry carries no signal and is dropped, whatever the model."""
    return 0.0


def noisy_reward(completion) -> float:
    """Every sample its own reward (no two equal): each group of its entry carries a signal and is kept."""
    return random.random()


def flat_and_noisy_mix(tmp_path) -> list[dict]:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"w{i}", "answer": "x"}) + "\n" for i in range(64)))
    return [{"name": "dataset", "label": label, "args": {"path": str(data), "reward": f"{__name__}:{reward}",
                                                         "num_eval": 2}}
            for label, reward in (("flat", "flat_reward"), ("noisy", "noisy_reward"))]  # fmt: skip


@pytest.mark.asyncio
@pytest.mark.parametrize("refill", ["entry", "mix"])
async def test_a_forced_refill_keeps_each_entry_s_share_while_the_budget_lasts(
    tmp_path, redis_url, unique_run_id, replicas, refill
):
    """One entry's groups never carry a signal (a constant reward), the other's always do (no two rewards equal). With
    advantage.refill = "entry" every dropped `flat` group is replaced by flat's own next task, outside the draw
    sequence, until the step's budget (oversample_limit x batch_size = 12 groups) is spent: a step keeps exactly the
    `noisy` groups it drew (its first 4 draws), closes short of batch_size, and the draw sequence goes on unchanged
    into the next step. With "mix" (the default) each replacement is a fresh draw, and noisy takes over flat's share."""
    cfg = mix_config(tmp_path, redis_url, unique_run_id, replicas, env=flat_and_noisy_mix(tmp_path), max_steps=2,
                     sampling={"max_tokens": 4}, advantage={"drop_zero_signal": True, "refill": refill,
                                                             "oversample_limit": 3},
                     # one group at a time: the order of the groups is the dispatch's, not the replicas' timing
                     max_inflight_groups=1)  # fmt: skip
    picks = expected_draws(cfg, 8)
    drawn = {step: [d for d in range(4 * (step - 1), 4 * step) if picks[d] == "noisy"] for step in (1, 2)}
    assert all(0 < len(noisy) < 4 for noisy in drawn.values()), picks  # each step draws both entries
    # and a flat draw before a noisy one: its refills are due before the step's later draws are made
    assert all("flat" in picks[4 * step : 4 * step + drawn[step + 1][-1] % 4] for step in (0, 1)), picks
    assert await asyncio.wait_for(OrchestratorService(cfg).run(), timeout=180) == 0

    groups = {(step, s["group"]): s for step, s in pushed_samples(redis_url, unique_run_id)}
    lines = {line["step"]: line for line in latest_per_step(read_events(cfg.output_dir / "events" /
                                                                        "orchestrator_steps.jsonl"))}  # fmt: skip
    assert sorted(lines) == [1, 2]
    assert all(s["env"] == "noisy" for s in groups.values())  # no flat group is ever trained
    for step, line in lines.items():
        kept = sorted(s["draw"] for (st, _), s in groups.items() if st == step)
        flat, noisy = line["envs"]["flat"], line["envs"]["noisy"]
        if refill == "mix":  # the fresh draws replacing flat's groups give noisy more than the share it drew
            assert len(kept) == line["num_groups"] == 4 > len(drawn[step])
            continue
        # the step's groups are its own 4 draws: noisy's kept, flat's replaced by flat's tasks (draw null, all
        # dropped) until 12 groups were generated; no fresh draw, so step 2's draws are the sequence's 4..7
        assert kept == drawn[step] and line["num_groups"] == len(drawn[step])
        assert line["generated_groups"] == 12
        assert noisy["generated_groups"] == noisy["num_groups"] == len(drawn[step])
        assert flat["generated_groups"] == flat["dropped_zero_signal"] == 12 - len(drawn[step])
        assert flat["num_groups"] == 0
