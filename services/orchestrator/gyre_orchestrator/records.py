"""A step's records: what is written for each rollout and each pushed step, and what it feeds metrics with.

- `ScoredRollout`: a finished rollout with its score; `rollout_record`: its line in the rollout dump;
- `batch_health`: a batch's learning-health figures;
- `StepRecords`: a pushed step's line of `orchestrator_steps.jsonl` (`record`) and its accounting (`account`:
  cumulative counters, metrics, W&B, the progress checkpoint).

`OrchestratorService.push` writes a step's line BEFORE it pushes the batch and accounts for it after; why is
explained there and in docs/architecture.md ("Event logs").
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
from gyre.config.orchestrator import OrchestratorConfig
from gyre.envs import Rollout, Score, Task
from gyre.rollouts import DETAILS, cap_details
from gyre.wandb_log import WandbLogger

from gyre_orchestrator.metrics import OrchestratorMetrics
from gyre_orchestrator.packing import TrainSample
from gyre_orchestrator.progress import Progress, ProgressStore
from gyre_orchestrator.scheduler import StepState
from gyre_orchestrator.teacher import Teacher, sampler_teacher_kl

log = logging.getLogger(__name__)


@dataclass
class ScoredRollout:
    """A finished rollout with its score: what the scheduler admits and the packer trains on."""

    task: Task
    task_index: int
    rollout: Rollout
    score: Score
    seconds: float
    teacher_logprobs: list[float] | None = None  # the teacher's log-prob of each token (distillation)
    env: str = ""  # the environment's label (a mix's entry)
    draw: int | None = 0  # the mix's draw that chose its task (None: a refill from its entry, advantage.refill)
    overlong_penalty: float = 0.0  # advantage.overlong_buffer's shaping (<= 0), already in `reward`

    @property
    def reward(self) -> float:
        """The shaped reward: the rubric's plus the overlong penalty (what groups are filtered and advantaged on)."""
        return self.score.reward + self.overlong_penalty

    @property
    def min_version(self) -> int:
        return self.rollout.policy_version_min

    @property
    def max_version(self) -> int:
        return self.rollout.policy_version_max


def rollout_record(step: int, sample: ScoredRollout, meta: dict) -> dict:
    """One line of `rollouts/step_{s}.jsonl`: what was generated, how it scored, and what it trains with."""
    r = sample.rollout
    # env: a mix's entry (task ids repeat across environments: `train-0-0` of each)
    keys = ("env", "task_id", "reward", "rewards", "advantage", "min_version", "max_version", "stop_reason",
            "num_turns", "num_loss_tokens", "group")  # fmt: skip
    record = {"step": step, "prompt": r.prompt, "completion": r.completion, "answer": sample.task.answer,
              **{k: meta[k] for k in keys}}  # fmt: skip
    if "overlong_penalty" in meta:  # advantage.overlong_buffer: the shaping already in `reward`
        record["overlong_penalty"] = meta["overlong_penalty"]
    # the environment's explanation of this sample (why it scored what it did), capped: a traceback stays small
    details = r.state.get(DETAILS)
    if sample.score.errors:  # a reward function that raised scored 0: its exception is this sample's reason too
        own = {} if details is None else details if isinstance(details, dict) else {"value": details}
        details = {**own, "reward_errors": dict(sample.score.errors)}
    details = cap_details(details)
    if details is not None:
        record[DETAILS] = details
    return record


def batch_health(samples: list[ScoredRollout]) -> dict:
    """Learning-health figures of a batch's samples (docs/metrics.md, "Learning health"): completion
    length (mean, p95), the fraction cut at the length limit, and each rubric function's mean score
    (the reward's components)."""
    lengths = np.asarray([s.rollout.num_completion_tokens for s in samples], dtype=np.float64)
    scores: dict[str, list[float]] = {}
    for s in samples:
        for name, value in s.score.per_function.items():
            scores.setdefault(name, []).append(float(value))
    return {
        "response_length_mean": float(lengths.mean()) if len(lengths) else 0.0,
        "response_length_p95": float(np.percentile(lengths, 95)) if len(lengths) else 0.0,
        "truncated_ratio": float(np.mean([s.rollout.stop_reason == "length" for s in samples])) if samples else 0.0,
        # cut short because a later turn's prompt did not extend the sampled tokens (gyre.envs.sequence): only a
        # warning in the log said so, and a template that always drifts trained every multi-turn sample on its first
        "drift_ratio": float(np.mean([s.rollout.stop_reason == "drift" for s in samples])) if samples else 0.0,
        "rubric_scores": {name: float(np.mean(values)) for name, values in sorted(scores.items())},
    }


# a step line's per-step count -> its cumulative count over the run
TOTALS = {
    "num_samples": "total_samples",
    "num_tokens": "total_tokens",
    "generated_tokens": "total_generated_tokens",
    "wasted_tokens": "total_wasted_tokens",
    "generated_groups": "total_generated_groups",
    "dropped_stale": "total_dropped_stale",
    "dropped_zero_signal": "total_dropped_zero_signal",
    "failed_rollouts": "total_failed_rollouts",
    "skipped_overlong": "total_skipped_overlong",
}


def _count(value) -> int:
    """A count read back from a step line (0 for anything that is not a non-negative int: a hand-edited line)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _counts(value) -> dict[str, int]:
    return {str(k): _count(v) for k, v in value.items()} if isinstance(value, dict) else {}


def _added(base: dict[str, int], counts: dict[str, int]) -> dict[str, int]:
    return {k: base.get(k, 0) + counts.get(k, 0) for k in {**base, **counts}}


def env_figures(st: StepState, samples: list[TrainSample], labels: list[str]) -> dict[str, dict]:
    """Per environment (label, config order) of a step: its trained samples and groups (as the step's `num_samples`
    and `num_groups`), the groups generated for it and dropped as zero-signal, the tasks skipped as too long, and the
    mean and std of the rewards of its admitted samples (as the step's `reward_mean`; None when it drew no group)."""

    def label_of(task) -> str:
        return getattr(task, "env", labels[0])

    rewards: dict[str, list[float]] = {label: [] for label in labels}
    figures = {label: {"num_samples": 0, "num_groups": 0, "generated_groups": 0, "dropped_zero_signal": 0,
                       "skipped_overlong": 0} for label in labels}  # fmt: skip
    kept = [] if st.zero_signal_batch else st.kept
    for group in st.finished:
        label = label_of(group.task)
        entry = figures.setdefault(label, {k: 0 for k in figures[labels[0]]})
        entry["generated_groups"] += 1
        entry["dropped_zero_signal"] += not any(group is g for g in kept)
        rewards.setdefault(label, []).extend(group.rewards)
    for group in st.kept:
        figures[label_of(group.task)]["num_groups"] += 1
    for sample in samples:
        figures[sample.meta["env"]]["num_samples"] += 1
    for task in st.overlong:
        figures.setdefault(label_of(task), {k: 0 for k in figures[labels[0]]})["skipped_overlong"] += 1
    for label, entry in figures.items():
        values = np.asarray(rewards.get(label, []), dtype=np.float64)
        entry["reward_mean"] = float(values.mean()) if len(values) else None
        entry["reward_std"] = float(values.std()) if len(values) else None
    return figures


class StepRecords:
    """A pushed step's line of orchestrator_steps.jsonl and its accounting: cumulative counters, metrics, W&B and
    the progress checkpoint."""

    def __init__(
        self,
        cfg: OrchestratorConfig,
        *,
        metrics: OrchestratorMetrics,
        wandb: WandbLogger,
        progress: ProgressStore,
        signals: dict,
        teacher: Teacher | None,
    ):
        self.cfg = cfg
        self.metrics = metrics
        self.wandb = wandb
        self.progress = progress
        self.signals = signals  # judges, reward models, teacher: name -> object with `stats`
        self.teacher = teacher
        # cumulative over the run (`total_*` in the step lines), continued by a restarted orchestrator (`resume`)
        self.counters: dict[str, int] = {}
        self.labels = [entry.key for entry in cfg.envs]
        self.env_totals: dict[str, int] = {}  # label -> samples trained over the run (`envs.*.total_samples`)
        # what a restarted orchestrator continues from: the counts of the steps before it (its process counts from 0)
        self.base_scoring_failures = 0
        self.base_reward_errors: dict[str, int] = {}
        self.base_signals: dict[str, dict[str, int]] = {}
        self._signal_counts: dict[str, dict[str, int]] = {}
        self._last_line: float | None = None  # when the previous step's line was made (throughput)

    def resume(self, previous: dict | None, checkpoint_counters: dict[str, int]) -> None:
        """Continue the cumulative counts of the line of the step before the resumed one (`previous`, from
        orchestrator_steps.jsonl): a restarted orchestrator's lines go on from there, so plots of `total_*`,
        `scoring_failures`, `reward_errors` and `signals` have no drop to 0 at a restart. Without such a line (an
        event log from before these counts, or deleted) the progress checkpoint's counters are the fallback."""
        if previous is None:
            self.counters = {k: int(v) for k, v in checkpoint_counters.items() if k in TOTALS.values()}
            return
        self.counters = {k: _count(previous.get(k)) for k in TOTALS.values() if k in previous}
        self.base_scoring_failures = _count(previous.get("scoring_failures"))
        self.base_reward_errors = _counts(previous.get("reward_errors"))
        signals = previous.get("signals")
        self.base_signals = {str(k): _counts(v) for k, v in signals.items()} if isinstance(signals, dict) else {}
        envs = previous.get("envs")
        if isinstance(envs, dict):  # per label: an entry renamed starts from 0
            self.env_totals = {str(k): _count(v.get("total_samples")) for k, v in envs.items() if isinstance(v, dict)}

    def record(
        self,
        st: StepState,
        samples: list[TrainSample],
        packed,
        cut: int,
        build_seconds: float,
        scoring_failures: int,
        reward_errors: dict[str, int],
        masked_truncated: int | None = None,
    ) -> dict:
        """The step's line of orchestrator_steps.jsonl (and of W&B). `masked_truncated`: samples left out of the batch
        as cut at the length limit (None: advantage.mask_truncated is off, the line has no such key)."""
        generated = np.asarray(st.all_rewards, dtype=np.float64)
        lags = np.asarray([s.meta["lag"] for s in samples], dtype=np.float64)
        num_tokens = int(sum(s.length for s in samples))
        # the price of filtering: completion tokens generated for this step that teach nothing (stale samples,
        # zero-signal groups); `advantage.oversample_limit` bounds it
        wasted_tokens = sum(s.rollout.num_completion_tokens for s in st.wasted)
        trained = [] if st.zero_signal_batch else [s for g in st.kept for s in g.samples]
        generated_tokens = wasted_tokens + sum(s.rollout.num_completion_tokens for s in trained)
        record = {
            "step": st.step,
            "reward_mean": float(generated.mean()),
            "reward_std": float(generated.std()),
            "num_samples": len(samples),
            "dropped_stale": st.dropped_stale,
            "dropped_zero_signal": st.dropped_zero_signal,
            "failed_rollouts": st.failed_rollouts,
            "skipped_overlong": st.skipped_overlong,
            "min_version": min(s.meta["min_version"] for s in samples),
            "max_version": max(s.meta["max_version"] for s in samples),
            "lag_mean": float(lags.mean()),
            "lag_max": int(lags.max()),
            "num_tokens": num_tokens,
            "step_seconds": st.seconds,
            # extras beyond the contract
            "env": ",".join(self.labels),  # a mix: its entries' labels
            "reward_mean_trained": float(np.mean([s.meta["reward"] for s in samples])),
            "num_groups": len(st.kept),
            "num_rows": packed.num_rows,
            "packing_efficiency": packed.efficiency,
            "truncated_to_seq_len": cut,
            "build_seconds": build_seconds,
            "generated_groups": st.generated_groups,
            "generated_tokens": generated_tokens,
            "wasted_tokens": wasted_tokens,
            "waste_fraction": wasted_tokens / generated_tokens if generated_tokens else 0.0,
            "zero_signal_batch": st.zero_signal_batch,
            # cumulative over the run: judges / reward models / teacher that failed, samples each reward function
            # raised on
            "scoring_failures": self.base_scoring_failures + scoring_failures,
            "reward_errors": _added(self.base_reward_errors, reward_errors),
            **batch_health([s for g in st.kept for s in g.samples]),
            # per environment (one, or a mix's entries by label): counts, rewards and cumulative samples
            "envs": env_figures(st, samples, self.labels),
        }
        if self.cfg.advantage.overlong_buffer.len:
            # the shaping, over the step's admitted samples (the batch health's): reward_* hold it, the rubric's
            # reward is reward - penalty
            admitted = [s.overlong_penalty for g in st.kept for s in g.samples]
            record["overlong_penalty_mean"] = float(np.mean(admitted)) if admitted else 0.0
            record["overlong_penalized"] = sum(p < 0 for p in admitted)
        if masked_truncated is not None:
            record["masked_truncated"] = masked_truncated
        # completion tokens generated per wall second since the previous step's line (PRIME-RL's throughput; the
        # process's first step: since its generation began): what the async level and the replicas deliver
        now = time.monotonic()
        since = now - self._last_line if self._last_line is not None else st.seconds
        self._last_line = now
        record["tokens_per_s"] = generated_tokens / since if since > 0 else 0.0
        # cumulative over the run, this step included (PRIME-RL's progress/total_*): an x-axis that a restart continues
        for key, total in TOTALS.items():
            record[total] = self.counters.get(total, 0) + int(record[key])
        for label, entry in record["envs"].items():
            entry["total_samples"] = self.env_totals.get(label, 0) + entry["num_samples"]
        record.update(self._signal_record(samples))
        return record

    def account(self, st: StepState, record: dict, lags: list[int], positions: tuple[dict[str, int], int]) -> None:
        """A pushed step's counters, metrics, W&B record and (every ckpt_interval) progress checkpoint;
        `positions`: the task mix's (cursors, draws)."""
        cfg, m = self.cfg, self.metrics
        # W&B takes flat numbers: each entry's figures as envs/<label>/<key>, a curve per environment
        self.wandb.log({**record, **{f"envs/{label}/{k}": v for label, entry in record["envs"].items()
                                     for k, v in entry.items() if v is not None}})  # fmt: skip
        self.counters = {total: int(record[total]) for total in TOTALS.values()}
        self.env_totals.update({label: entry["total_samples"] for label, entry in record["envs"].items()})
        labels = m.labels
        labels(m.step).set(st.step)
        labels(m.batches).inc()
        labels(m.samples).inc(record["num_samples"])
        labels(m.dropped_stale).inc(st.dropped_stale)
        labels(m.dropped_zero_signal).inc(st.dropped_zero_signal)
        groups = st.kept  # a zero-signal batch's too: what it trains on
        for env, entry in record["envs"].items():
            # per entry of a mix (one environment: its figures are the step's); one that drew no group this step
            # keeps its last value, as a gauge of a step without samples would
            labels(m.skipped_overlong, env=env).inc(entry["skipped_overlong"])
            if entry["reward_mean"] is not None:
                labels(m.reward_mean, env=env).set(entry["reward_mean"])
                labels(m.reward_std, env=env).set(entry["reward_std"])
            mine = [s for g in groups if getattr(g.task, "env", self.labels[0]) == env for s in g.samples]
            if mine:
                health = batch_health(mine)
                labels(m.response_length, env=env, stat="mean").set(health["response_length_mean"])
                labels(m.response_length, env=env, stat="p95").set(health["response_length_p95"])
                labels(m.truncated_ratio, env=env).set(health["truncated_ratio"])
                labels(m.drift_ratio, env=env).set(health["drift_ratio"])
                if cfg.advantage.overlong_buffer.len:
                    labels(m.overlong_penalty, env=env).set(float(np.mean([s.overlong_penalty for s in mine])))
                for name, value in health["rubric_scores"].items():
                    labels(m.rubric_score, env=env, function=name).set(value)
        labels(m.generated_groups).inc(st.generated_groups)
        labels(m.masked_truncated).inc(record.get("masked_truncated", 0))
        labels(m.generated_tokens).inc(record["generated_tokens"])
        labels(m.wasted_tokens).inc(record["wasted_tokens"])
        labels(m.batch_tokens).inc(record["num_tokens"])
        labels(m.packing_efficiency).set(record["packing_efficiency"])
        labels(m.batch_seconds).set(st.seconds)
        for lag in lags:
            labels(m.lag).observe(lag)
        mix = "".join(
            f", {env}: {entry['num_samples']} samples, reward {entry['reward_mean']:.3f}"
            if entry["reward_mean"] is not None else f", {env}: no group"
            for env, entry in record["envs"].items()
        ) if len(record["envs"]) > 1 else ""  # fmt: skip
        log.info(
            "pushed step %d: %d samples, reward %.3f, versions %d..%d (off-policy lag %.1f, max %d), %.0f tokens/s, "
            "%d stale, %d zero-signal groups (%.0f%% of generated tokens wasted)%s%s",
            st.step,
            record["num_samples"],
            record["reward_mean"],
            record["min_version"],
            record["max_version"],
            record["lag_mean"],
            record["lag_max"],
            record["tokens_per_s"],
            st.dropped_stale,
            st.dropped_zero_signal,
            100 * record["waste_fraction"],
            f", {st.skipped_overlong} tasks skipped (prompt too long)" if st.skipped_overlong else "",
            mix,
            extra={"step": st.step},  # a field of its own in JSON logs (log.format), for a log query by step
        )
        if cfg.ckpt_interval and st.step % cfg.ckpt_interval == 0:
            self.save_progress(st.step, positions)

    def save_progress(self, step: int, positions: tuple[dict[str, int], int]) -> None:
        """Progress checkpoint `step` (the last pushed) with the counters so far; `positions`: the task mix's state."""
        cursors, draws = positions
        self.progress.save(Progress(step=step, task_index=cursors.get(self.labels[0], 0), counters=dict(self.counters),
                                    cursors=cursors, draws=draws, seed=self.cfg.seed,
                                    env=self.cfg.model_dump(mode="json")["env"]))  # fmt: skip

    def _signal_record(self, samples: list[TrainSample]) -> dict:
        """Per reward function its mean over the batch (judges at weight 0 included: that is how they are
        logged), per signal endpoint its cumulative call counts (also exported as metrics), and with a teacher the
        mean sampler-side reverse KL, lp_inference - lp_teacher over the sampled tokens."""
        names = sorted({name for s in samples for name in s.meta["rewards"]})
        record: dict = {
            "rewards_mean": {n: float(np.mean([s.meta["rewards"].get(n, 0.0) for s in samples])) for n in names}
        }
        if self.signals:
            for name, signal in self.signals.items():  # the metrics count this process's calls (a counter resets)
                seen = self._signal_counts.setdefault(name, {})
                for outcome, count in signal.stats.items():
                    self.metrics.labels(self.metrics.signal_calls, signal=name, outcome=outcome).inc(
                        count - seen.get(outcome, 0)
                    )
                    seen[outcome] = count
            record["signals"] = {name: _added(self.base_signals.get(name, {}), dict(signal.stats))
                                 for name, signal in self.signals.items()}  # fmt: skip
        if self.teacher is not None:
            record["teacher_kl"] = sampler_teacher_kl(samples)
        return record
