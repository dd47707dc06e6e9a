"""A closed step's groups as the samples the trainer gets: group advantages, each sample cut to `batch.seq_len`,
DAPO's overlong filtering (`advantage.mask_truncated`), per-sample metadata and rollout-dump lines. Packing them into
the batch is `gyre_orchestrator.packing`."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from gyre.config.orchestrator import OrchestratorConfig

from gyre_orchestrator.advantages import compute_advantages
from gyre_orchestrator.packing import TrainSample
from gyre_orchestrator.records import ScoredRollout, rollout_record
from gyre_orchestrator.scheduler import StepState
from gyre_orchestrator.teacher import teacher_arrays

log = logging.getLogger(__name__)


@dataclass
class StepSamples:
    samples: list[TrainSample]
    cut: int  # samples cut to batch.seq_len (they train on their prefix)
    masked: int  # truncated samples left out of the loss (advantage.mask_truncated)


def step_samples(
    st: StepState, cfg: OrchestratorConfig, temperature: float, with_teacher: bool, records: list[dict] | None = None
) -> StepSamples:
    """The samples of closed step `st`: its kept groups' advantages, each sample cut to `batch.seq_len`, with its
    metadata (and the teacher's arrays when `with_teacher`).

    With `records`, also appends each trained sample's rollout-dump line (`gyre.rollouts`) to it.
    With `advantage.mask_truncated`, a sample cut at the length limit is left out of the batch (DAPO's overlong
    filtering), and so is one cut to `batch.seq_len` (its reward covers tokens the trainer never sees), after its
    group's advantages were computed over all the group's samples, as DAPO does: out of the loss and of its
    normalisers (loss tokens, samples), which a zero advantage alone would not be.
    """
    groups = st.kept
    rewards = [[s.reward for s in g.samples] for g in groups]
    lengths = [[s.rollout.num_completion_tokens for s in g.samples] for g in groups]
    advantages = compute_advantages(rewards, cfg.advantage.type, std_norm=cfg.advantage.std_norm, lengths=lengths)
    samples: list[TrainSample] = []
    masked: list[tuple[TrainSample, ScoredRollout]] = []  # truncated samples left out (mask_truncated)
    cut = 0
    for gi, (group, adv) in enumerate(zip(groups, advantages, strict=True)):
        for s, a in zip(group.samples, adv, strict=True):
            r = s.rollout
            ids, mask, lps = r.token_ids, r.loss_mask, r.logprobs
            was_cut = len(ids) > cfg.batch.seq_len
            if was_cut:
                # the trainer cannot take it whole: keep the prefix, say so (counted in the event)
                cut += 1
                ids, mask, lps = ids[: cfg.batch.seq_len], mask[: cfg.batch.seq_len], lps[: cfg.batch.seq_len]
            # a sample the teacher refused (or scored but its last token) keeps its reward term: teacher_mask
            teacher, scored = teacher_arrays(s.teacher_logprobs, len(ids)) if with_teacher else (None, None)
            if not any(mask):
                continue  # nothing the model sampled survives: no loss tokens, nothing to learn
            meta = {
                "reward": s.reward,
                "advantage": float(a),
                "min_version": s.min_version,
                "max_version": s.max_version,
                "lag": (st.step - 1) - s.min_version,
                "env": s.env,  # the entry's label in a mix
                "task_id": s.task.id,
                "task_index": s.task_index,  # in the entry's train split
                "draw": s.draw,  # the mix's draw number (a restart continues after the newest)
                "group": gi,
                "num_turns": r.num_turns,
                "stop_reason": r.stop_reason,
                "num_tokens": len(ids),
                "num_loss_tokens": int(sum(mask)),
                "rewards": dict(s.score.per_function),
                "temperature": temperature,
            }
            if cfg.advantage.overlong_buffer.len:
                meta["overlong_penalty"] = s.overlong_penalty  # `reward` holds it: the rubric's is reward - this
            sample = TrainSample(np.asarray(ids), np.asarray(mask), np.asarray(lps), float(a), meta, teacher,
                                 scored)  # fmt: skip
            if cfg.advantage.mask_truncated and (r.stop_reason == "length" or was_cut):
                masked.append((sample, s))
                continue
            samples.append(sample)
            if records is not None:
                records.append(rollout_record(st.step, s, meta))
    if masked and not samples:
        # every sample was cut at the limit: the step still needs a batch (the trainer waits for it), one with no
        # loss token, whose update the trainer skips (the step counts as trained)
        log.warning("step %d: every sample (%d) was cut at the length limit and advantage.mask_truncated leaves "
                    "them out of the loss: the batch has no loss token and trains nothing", st.step,
                    len(masked))  # fmt: skip
        for sample, s in masked:
            sample.loss_mask[:] = False
            sample.meta["num_loss_tokens"] = 0
            samples.append(sample)
            if records is not None:
                records.append(rollout_record(st.step, s, sample.meta))
    return StepSamples(samples, cut, len(masked))
