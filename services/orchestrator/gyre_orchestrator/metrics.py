"""Prometheus metrics of the orchestrator (`gyre_orchestrator_*`), on one registry per service instance.

Every metric carries the `run_id` label so one Prometheus can hold several experiments apart.
Throughput is exposed as counters (`*_total`) that dashboards `rate()`; per-step values as gauges.
"""

from __future__ import annotations

from gyre import metrics as m
from prometheus_client import CollectorRegistry

# a multi-turn rollout with tools can run for many minutes
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)
LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
# a relay waits for every replica to load the weights: many minutes for a large model (inference's UPDATE_BUCKETS)
RELAY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 900, 1200, 1800, 3600)
OUTCOMES = ("ok", "truncated", "error", "stale")


class OrchestratorMetrics:
    """All orchestrator metrics. Create one per process (tests pass a fresh `CollectorRegistry`)."""

    def __init__(self, run_id: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.run_id = run_id
        r = self.registry
        run = ("run_id",)
        self.step = m.gauge("gyre_orchestrator_step", "Last batch step pushed to the stream.", run, r)
        self.batches = m.counter("gyre_orchestrator_batches_total", "Batches pushed to the stream.", run, r)
        self.samples = m.counter("gyre_orchestrator_samples_total", "Samples pushed in batches.", run, r)
        # over the samples generated for the step, not the batch: with drop_zero_signal the batch's mean leaves out
        # the all-equal groups (on a hard task, the all-zero ones) and would rise with filtering, not with learning
        self.reward_mean = m.gauge(
            "gyre_orchestrator_reward_mean",
            "Mean reward of the samples generated for the last step (its dropped zero-signal groups included).",
            (*run, "env"),
            r,
        )
        self.reward_std = m.gauge(
            "gyre_orchestrator_reward_std",
            "Reward standard deviation of the samples generated for the last step (its dropped zero-signal groups "
            "included).",
            (*run, "env"),
            r,
        )
        self.eval_reward = m.gauge(
            "gyre_orchestrator_eval_reward",
            "Last evaluation of the held-out split; stat = avg_at_k (mean reward) or pass_at_k (fraction solved).",
            (*run, "env", "stat"),
            r,
        )
        self.rollouts = m.counter(
            "gyre_orchestrator_rollouts_total",
            "Finished rollouts by outcome: ok, truncated (length/turn budget/drift), error, stale (dropped).",
            (*run, "env", "outcome"),
            r,
        )
        self.rollout_latency = m.histogram(
            "gyre_orchestrator_rollout_latency_seconds",
            "Wall time of one rollout (all its model turns and environment replies) plus scoring.",
            (*run, "env"),
            r,
            buckets=LATENCY_BUCKETS,
        )
        self.lag = m.histogram(
            "gyre_orchestrator_policy_lag_steps",
            "Off-policy lag of each trained sample: (step - 1) - oldest policy version that produced it.",
            run,
            r,
            buckets=LAG_BUCKETS,
        )
        self.dropped_stale = m.counter(
            "gyre_orchestrator_dropped_stale_samples_total",
            "Samples dropped (and regenerated) because their policy version was below the async bound.",
            run,
            r,
        )
        self.dropped_zero_signal = m.counter(
            "gyre_orchestrator_dropped_zero_signal_groups_total",
            "Groups dropped because all their rewards were equal (no advantage signal).",
            run,
            r,
        )
        self.skipped_overlong = m.counter(
            "gyre_orchestrator_skipped_overlong_tasks_total",
            "Tasks skipped (and replaced) because their prompt plus sampling.max_tokens does not fit the model's "
            "context.",
            (*run, "env"),
            r,
        )
        self.generated_groups = m.counter(
            "gyre_orchestrator_generated_groups_total",
            "Groups generated for batches, kept or dropped (zero signal).",
            run,
            r,
        )
        self.generated_tokens = m.counter(
            "gyre_orchestrator_generated_completion_tokens_total",
            "Completion tokens generated for batches, trained or not (stale samples, zero-signal groups).",
            run,
            r,
        )
        self.wasted_tokens = m.counter(
            "gyre_orchestrator_wasted_completion_tokens_total",
            "Completion tokens generated for batches that teach nothing: stale samples and zero-signal groups.",
            run,
            r,
        )
        self.batch_tokens = m.counter(
            "gyre_orchestrator_batch_tokens_total", "Tokens pushed in batches (padding excluded).", run, r
        )
        self.packing_efficiency = m.gauge(
            "gyre_orchestrator_packing_efficiency_ratio",
            "Tokens of the last batch / (rows x seq_len).",
            run,
            r,
        )
        self.batch_seconds = m.gauge(
            "gyre_orchestrator_batch_generation_seconds",
            "Wall time from the first dispatch of the last batch to its close.",
            run,
            r,
        )
        self.relay_duration = m.histogram(
            "gyre_orchestrator_weight_relay_duration_seconds",
            "Time from learning of a weights version to every replica in rotation serving it.",
            run,
            r,
            buckets=RELAY_BUCKETS,
        )
        self.relay_calls = m.counter(
            "gyre_orchestrator_weight_relay_calls_total", "UpdateWeights calls by result.", (*run, "result"), r
        )
        self.replica_version = m.gauge(
            "gyre_orchestrator_replica_policy_version",
            "Policy version each inference replica serves (-1 unknown).",
            (*run, "replica"),
            r,
        )
        self.replica_up = m.gauge(
            "gyre_orchestrator_replica_up", "1 if the replica is in rotation, else 0.", (*run, "replica"), r
        )
        self.max_async_level = m.gauge(
            "gyre_orchestrator_max_async_level",
            "The async bound k: batch s only holds samples from policy versions >= s-1-k.",
            run,
            r,
        )
        self.signal_calls = m.counter(
            "gyre_orchestrator_signal_calls_total",
            "Calls to the models a run takes signals from (judges, reward models, the teacher) by signal name and "
            "outcome: requests, ok, retries, timeouts, errors, failures (after every retry), refused (400/413/422: "
            "that request's content), cache_hits, unparsed, unreadable (samples with no readable verdict: "
            "unjudged, 0), skipped / cut (teacher: samples trained without a distillation term / without one on "
            "their last token).",
            (*run, "signal", "outcome"),
            r,
        )
        self.scoring_failures = m.counter(
            "gyre_orchestrator_scoring_failures_total",
            "Scorings that failed (a judge, reward model or the teacher failed after its retries); the same "
            "completion is scored again (sample_attempts in all, then the run stops), never counted as reward 0.",
            (*run, "env"),
            r,
        )
        self.eval_scoring_failures = m.counter(
            "gyre_orchestrator_eval_scoring_failures_total",
            "Scorings of eval samples that failed (a judge or reward model failed after its retries); the same "
            "completion is scored again (sample_attempts in all, then the eval fails).",
            (*run, "env"),
            r,
        )
        self.latest_weights = m.gauge(
            "gyre_orchestrator_latest_weights_step", "Newest weights version the orchestrator knows of.", run, r
        )
        # learning health of the last batch (docs/metrics.md, "Learning health")
        self.response_length = m.gauge(
            "gyre_orchestrator_response_length_tokens",
            "Completion tokens per sample of the last batch (all model turns); stat = mean or p95.",
            (*run, "env", "stat"),
            r,
        )
        self.truncated_ratio = m.gauge(
            "gyre_orchestrator_truncated_ratio",
            "Fraction of the last batch's samples cut at the length limit (stop_reason length).",
            (*run, "env"),
            r,
        )
        self.drift_ratio = m.gauge(
            "gyre_orchestrator_drift_ratio",
            "Fraction of the last batch's samples cut at a turn whose prompt did not extend the sampled tokens "
            "(stop_reason drift).",
            (*run, "env"),
            r,
        )
        self.overlong_penalty = m.gauge(
            "gyre_orchestrator_overlong_penalty_mean",
            "Mean overlong penalty (advantage.overlong_buffer, <= 0, already in the reward) of the last batch's "
            "samples; set only with the shaping on.",
            (*run, "env"),
            r,
        )
        self.masked_truncated = m.counter(
            "gyre_orchestrator_masked_truncated_samples_total",
            "Samples cut at the length limit and left out of the loss (advantage.mask_truncated).",
            run,
            r,
        )
        self.rubric_score = m.gauge(
            "gyre_orchestrator_rubric_score_mean",
            "Mean unweighted score of each rubric function (the reward's components) over the last batch.",
            (*run, "env", "function"),
            r,
        )
        # demand on the inference replicas (what `inference.autoscaling` scales on)
        self.model_requests = m.gauge(
            "gyre_orchestrator_model_requests",
            "Model requests outstanding now: state = inflight (sent to a replica) or queued (waiting for a "
            "concurrency slot or an eligible replica).",
            (*run, "state"),
            r,
        )

        # the Redis holding the batch streams (docs/kubernetes.md, "Redis memory"), read after each push
        self.redis_memory = m.gauge(
            "gyre_orchestrator_redis_memory_bytes",
            "Memory of the Redis holding the batch streams after the last push: state = used, or max (its maxmemory; "
            "0 = no limit).",
            (*run, "state"),
            r,
        )

        # the trainer's dead letters (it keeps the newest intake.dead_letter_maxlen), read every 5 s by the stream watch
        self.dead_letters = m.gauge(
            "gyre_orchestrator_dead_letters",
            "Batch entries in the dead-letter stream gyre:{run}:batches:dead: state = held (the newest, kept for "
            "inspection), or trimmed (the oldest, dropped to bound Redis memory).",
            (*run, "state"),
            r,
        )

    def labels(self, metric, **labels):
        return metric.labels(run_id=self.run_id, **labels)
