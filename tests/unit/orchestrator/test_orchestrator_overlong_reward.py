"""DAPO's two length treatments (docs/algorithms.md): overlong reward shaping (`advantage.overlong_buffer`) and
overlong filtering (`advantage.mask_truncated`), through the orchestrator's own rollout and batch-building path."""

from __future__ import annotations

import numpy as np
import pytest
from gyre.codec import decode_batch, encode_batch
from gyre.config import ConfigError, load_config
from gyre.config.orchestrator import OrchestratorConfig
from gyre.envs import Rollout, Score
from gyre_orchestrator.advantages import overlong_penalty
from gyre_orchestrator.mix import MixTask
from gyre_orchestrator.records import ScoredRollout
from gyre_orchestrator.scheduler import Group, RolloutKey, StepState
from gyre_orchestrator.service import OrchestratorService

PROMPT = 3  # prompt tokens of every test rollout


def test_the_penalty_is_zero_before_the_buffer_then_linear_and_held_at_the_factor():
    # L_max 100, L_buf 20: the penalty starts past 80 tokens, -factor * (|y| - 80) / 20
    assert overlong_penalty(60, 100, 20, 1.0) == 0.0
    assert overlong_penalty(80, 100, 20, 1.0) == 0.0  # at the start of the buffer: nothing yet
    assert overlong_penalty(81, 100, 20, 1.0) == pytest.approx(-0.05)  # 1/20
    assert overlong_penalty(90, 100, 20, 1.0) == pytest.approx(-0.5)  # 10/20
    assert overlong_penalty(100, 100, 20, 1.0) == pytest.approx(-1.0)  # at the limit: the whole factor
    assert overlong_penalty(130, 100, 20, 1.0) == pytest.approx(-1.0)  # (a multi-turn total past it) clipped
    assert overlong_penalty(85, 100, 20, 0.5) == pytest.approx(-0.125)  # 0.5 * 5/20
    assert overlong_penalty(99, 100, 20, 0.0) == 0.0 and overlong_penalty(100, 100, 0, 1.0) == 0.0  # off
    with pytest.raises(ValueError, match="buffer 100 must be < the length limit 100"):
        overlong_penalty(90, 100, 100, 1.0)


def cfg_of(tmp_path, **advantage) -> OrchestratorConfig:
    return load_config(OrchestratorConfig, [], output_dir=str(tmp_path), redis={"url": "redis://127.0.0.1:9"},
                       sampling={"max_tokens": 20}, advantage=advantage)  # fmt: skip


def test_the_config_keys_default_off_and_bad_values_are_refused_naming_the_key(tmp_path):
    cfg = cfg_of(tmp_path)
    assert (cfg.advantage.overlong_buffer.len, cfg.advantage.mask_truncated) == (0, False)
    cfg = cfg_of(tmp_path, overlong_buffer={"len": 5, "penalty_factor": 0.5}, mask_truncated=True)
    assert (cfg.advantage.overlong_buffer.len, cfg.advantage.overlong_buffer.penalty_factor) == (5, 0.5)
    key = "config key 'advantage.overlong_buffer.len': "
    with pytest.raises(ConfigError, match=key + r"20 must be < sampling\.max_tokens = 20"):
        cfg_of(tmp_path, overlong_buffer={"len": 20})
    with pytest.raises(ConfigError, match=key + r"8 must be < env\.1\.sampling\.max_tokens = 8"):
        load_config(OrchestratorConfig, [], output_dir=str(tmp_path), sampling={"max_tokens": 20},
                    env=[{"name": "reverse_text"}, {"name": "arithmetic", "sampling": {"max_tokens": 8}}],
                    advantage={"overlong_buffer": {"len": 8}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"advantage\.overlong_buffer\.penalty_factor.*greater than or equal to 0"):
        cfg_of(tmp_path, overlong_buffer={"len": 5, "penalty_factor": -1})


def rollout(completion: int, stop_reason: str = "done") -> Rollout:
    n = PROMPT + completion
    return Rollout(task_id="t", prompt=[{"role": "user", "content": "q"}], completion=[], turns=[],
                   token_ids=list(range(1, n + 1)), loss_mask=[False] * PROMPT + [True] * completion,
                   logprobs=[0.0] * PROMPT + [-0.5] * completion, prompt_len=PROMPT, sequence_turns=1,
                   policy_version_min=0, policy_version_max=0, stop_reason=stop_reason)  # fmt: skip


class LengthEnv:
    """Answers each rollout with the next completion length of `lengths`, all scored 1 (the shaping alone differs)."""

    max_turns = 1

    def __init__(self, lengths: list[int]):
        self.lengths = list(lengths)

    async def rollout(self, client, task, sampling):
        return rollout(self.lengths.pop(0))

    async def score(self, task, r):
        return Score(reward=1.0, per_function={"correct": 1.0})


def step_of(samples: list) -> StepState:
    """A closed step of one group, `samples`."""
    group = Group(step=1, task=None, samples=samples, dispatched_version=0)
    return StepState(step=1, floor=0, kept=[group], all_rewards=group.rewards, first_dispatch=0.0, closed_at=1.0)


def service_of(cfg: OrchestratorConfig, env=None) -> OrchestratorService:
    service = OrchestratorService(cfg)
    service.redis.close()  # never connected: the batch is built, not pushed
    if env is not None:
        service.envs = {cfg.envs[0].key: env}
    return service


@pytest.mark.asyncio
async def test_a_sample_in_the_buffer_gets_its_reward_shaped_before_the_advantages(tmp_path):
    # max_tokens 20, buffer 8, factor 0.5: the penalty starts past 12 tokens; lengths 10, 16, 20 score 1 each
    cfg = cfg_of(tmp_path, overlong_buffer={"len": 8, "penalty_factor": 0.5}, drop_zero_signal=True)
    service = service_of(cfg, LengthEnv([10, 16, 20]))
    item = MixTask(env=cfg.envs[0].key, index=0, draw=0, task=type("T", (), {"id": "t", "answer": ""})())
    samples = [await service._generate(item, 0, RolloutKey(1, i)) for i in range(3)]
    # 10: none; 16: -0.5 * 4/8 = -0.25; 20: -0.5 * 8/8 = -0.5
    assert [s.overlong_penalty for s in samples] == pytest.approx([0.0, -0.25, -0.5])
    assert [s.reward for s in samples] == pytest.approx([1.0, 0.75, 0.5])  # the rubric's 1, shaped
    assert [s.score.reward for s in samples] == [1.0, 1.0, 1.0]  # kept as the rubric gave it

    # equal rubric rewards, different lengths: a signal now. drgrpo: the shaped rewards less their mean 0.75
    st = step_of(samples)
    built, packed, _, _ = service.build_batch(st)
    assert [s.advantage for s in built] == pytest.approx([0.25, 0.0, -0.25])
    assert [m["reward"] for m in packed.batch.samples] == pytest.approx([1.0, 0.75, 0.5])
    assert [m["overlong_penalty"] for m in packed.batch.samples] == pytest.approx([0.0, -0.25, -0.5])
    line = service.step_records.record(st, built, packed, 0, 0.0, 0, {})
    assert line["overlong_penalty_mean"] == pytest.approx(-0.25) and line["overlong_penalized"] == 2
    service.step_records.account(st, line, [0, 0, 0], ({}, 0))
    gauge = service.metrics.registry.get_sample_value(
        "gyre_orchestrator_overlong_penalty_mean", {"run_id": cfg.run_id, "env": "reverse_text"})  # fmt: skip
    assert gauge == pytest.approx(-0.25)


def scored(completion: int, reward: float, stop_reason: str = "done") -> ScoredRollout:
    return ScoredRollout(task=type("T", (), {"id": "t", "answer": ""})(), task_index=0,
                         rollout=rollout(completion, stop_reason), score=Score(reward=reward, per_function={}),
                         seconds=0.0, env="reverse_text")  # fmt: skip


def loss_tokens_per_sample(batch) -> dict[int, int]:
    """Sample index -> its loss tokens, read from the packed rows the trainer gets."""
    counts: dict[int, int] = {}
    for rank in batch.micro_batches:
        for mb in rank:
            starts = np.cumsum(mb.sample_lengths) - mb.sample_lengths
            for index, start, length in zip(mb.sample_index, starts, mb.sample_lengths, strict=True):
                counts[int(index)] = int(mb.loss_mask[start : start + length].sum())
    return counts


@pytest.mark.asyncio
@pytest.mark.parametrize("mask", [False, True])
async def test_a_truncated_sample_is_left_out_of_the_loss_the_trainer_gets(tmp_path, mask):
    # one group: a right answer (5 tokens), a wrong one (6), and one cut at the limit (20, stop_reason length)
    cfg = cfg_of(tmp_path, mask_truncated=mask)
    service = service_of(cfg)
    group = [scored(5, 1.0), scored(6, 0.0), scored(20, 0.0, "length")]
    st = step_of(group)
    built, packed, _, masked = service.build_batch(st)
    batch = decode_batch(encode_batch(packed.batch))  # what the trainer reads off the stream
    counts = loss_tokens_per_sample(batch)
    # DAPO: the group's advantages over all three (mean 1/3), then the truncated one is masked
    trained = {m["num_tokens"]: m["advantage"] for m in batch.samples if not m.get("padding")}
    assert trained[PROMPT + 5] == pytest.approx(2 / 3) and trained[PROMPT + 6] == pytest.approx(-1 / 3)
    if not mask:  # as before: the truncated sample trains, with its advantage -1/3
        assert masked == 0 and batch.num_samples == 3 and batch.num_loss_tokens == 31
        assert sorted(counts.values()) == [5, 6, 20]
        return
    # its tokens are in no loss mask and no normaliser (token sum, sample count)
    assert masked == 1 and PROMPT + 20 not in trained
    assert batch.num_samples == 2 and batch.num_loss_tokens == 11 and sorted(counts.values()) == [5, 6]
    line = service.step_records.record(st, built, packed, 0, 0.0, 0, {}, masked)
    assert line["masked_truncated"] == 1
    service.step_records.account(st, line, [0, 0], ({}, 0))
    total = "gyre_orchestrator_masked_truncated_samples_total"
    assert service.metrics.registry.get_sample_value(total, {"run_id": cfg.run_id}) == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("mask", [False, True])
async def test_a_sample_cut_to_seq_len_counts_as_truncated(tmp_path, mask, caplog):
    """A finished reply longer than `batch.seq_len` is cut to it: its reward is the whole reply's, its loss the
    prefix's. mask_truncated left it in (only `stop_reason` length counted as cut); without it, one warning a run."""
    cfg = load_config(OrchestratorConfig, [], output_dir=str(tmp_path), redis={"url": "redis://127.0.0.1:9"},
                      sampling={"max_tokens": 20}, batch={"seq_len": 16},
                      advantage={"mask_truncated": mask})  # fmt: skip
    service = service_of(cfg)
    for _ in range(2):  # two steps: one warning
        st = step_of([scored(5, 1.0), scored(6, 0.0), scored(18, 1.0)])  # 3 + 18 tokens: past 16, stop "done"
        built, packed, cut, masked = service.build_batch(st)
        counts = loss_tokens_per_sample(decode_batch(encode_batch(packed.batch)))
        assert cut == 1
        if mask:
            assert masked == 1 and sorted(counts.values()) == [5, 6]
        else:
            assert masked == 0 and sorted(counts.values()) == [5, 6, 16 - PROMPT]
    warnings = [r for r in caplog.records if "longer than batch.seq_len = 16" in r.getMessage()]
    assert len(warnings) == (0 if mask else 1)


@pytest.mark.asyncio
async def test_a_step_whose_samples_were_all_truncated_pushes_a_batch_without_loss_tokens(tmp_path):
    cfg = cfg_of(tmp_path, mask_truncated=True)
    group = [scored(20, 1.0, "length"), scored(20, 0.0, "length")]
    st = step_of(group)
    built, packed, _, masked = service_of(cfg).build_batch(st)
    assert masked == 2 and len(built) == 2
    assert packed.batch.num_loss_tokens == 0 and packed.batch.num_samples == 2  # the trainer skips its update


@pytest.mark.asyncio
async def test_the_defaults_leave_the_records_and_rewards_as_they_were(tmp_path):
    service = service_of(cfg_of(tmp_path), LengthEnv([20, 20]))
    item = MixTask(env="reverse_text", index=0, draw=0, task=type("T", (), {"id": "t", "answer": ""})())
    sample = await service._generate(item, 0, RolloutKey(1, 0))
    assert (sample.overlong_penalty, sample.reward) == (0.0, 1.0)  # at the limit, no shaping when off
    st = step_of([sample, scored(5, 0.0)])
    built, packed, _, _ = service.build_batch(st)
    line = service.step_records.record(st, built, packed, 0, 0.0, 0, {})
    assert not {"overlong_penalty_mean", "overlong_penalized", "masked_truncated"} & set(line)
    assert "overlong_penalty" not in packed.batch.samples[0]


@pytest.mark.asyncio
async def test_a_multi_turn_episode_past_its_environments_turn_budget_is_shaped_per_turn_taken(tmp_path):
    """A verifiers harness without agent.max_turns decides its turns (the environment says 1): a 3-turn episode of 10
    tokens a turn (max_tokens 20) was shaped as overlong against one turn's 20 and lost the whole factor."""

    class ThreeTurns(LengthEnv):
        async def rollout(self, client, task, sampling):
            sample = rollout(self.lengths.pop(0))
            sample.sequence_turns = 3
            return sample

    cfg = cfg_of(tmp_path, overlong_buffer={"len": 8, "penalty_factor": 0.5})
    service = service_of(cfg, ThreeTurns([30, 56]))
    item = MixTask(env=cfg.envs[0].key, index=0, draw=0, task=type("T", (), {"id": "t", "answer": ""})())
    samples = [await service._generate(item, 0, RolloutKey(1, i)) for i in range(2)]
    # budget 3 x 20 = 60, the penalty past 52: 30 tokens none; 56: -0.5 * 4/8
    assert [s.overlong_penalty for s in samples] == pytest.approx([0.0, -0.25])
