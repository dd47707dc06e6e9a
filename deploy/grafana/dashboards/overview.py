"""The experiment overview dashboard: reward, speed, async lag, utilisation and weight sync at a
glance, a row on rollouts and batches, and a learning-health row with one panel per learning alert."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import timeseries

from .panels import NATS, STEPS, TOKENS_PER_S, base, mean_of, panel, quantile, rate, sel, stat_panel


def overview() -> db.Dashboard:
    d = base(
        "gyre-overview",
        "Gyre / Experiment overview",
        "One RL experiment at a glance: reward, speed, async lag, utilisation and weight sync.",
        # the orchestrator's too: a run whose trainer never came up (pending on GPUs) is listed, with its rollouts
        "gyre_trainer_step|gyre_orchestrator_step",
    )
    d = (
        d.with_panel(stat_panel("Trainer step", "none", f"max by (run_id) ({sel('gyre_trainer_step')})",
                                "Last trained and published step."))
        .with_panel(stat_panel("Orchestrator step", "none", f"max by (run_id) ({sel('gyre_orchestrator_step')})",
                               "Last batch pushed to the trainer's stream."))
        .with_panel(stat_panel("Oldest served version", "none",
                               f"min by (run_id) ({sel('gyre_inference_policy_version')})",
                               "Oldest policy version any inference replica serves."))
        .with_panel(stat_panel("MFU", "percentunit", f"avg by (run_id) ({sel('gyre_trainer_mfu_ratio')})",
                               "Model FLOPs utilisation of the last step, mean over trainer ranks."))
        .with_panel(stat_panel("Trainer tokens/s", TOKENS_PER_S, rate("gyre_trainer_tokens_total"),
                               "Tokens trained per second of wall time."))
        .with_panel(stat_panel("Inference tokens/s", TOKENS_PER_S, rate("gyre_inference_generation_tokens_total"),
                               "Tokens generated per second, all replicas."))
    )  # fmt: skip
    panels = [
        panel(
            "Reward",
            "none",
            [
                (f"avg by (run_id, env) ({sel('gyre_orchestrator_reward_mean')})", "train {{run_id}} {{env}}"),
                (
                    "avg by (run_id, env) (" + sel("gyre_orchestrator_eval_reward", 'stat="avg_at_k"') + ")",
                    "eval avg@k {{run_id}} {{env}}",
                ),
            ],
            "Mean reward of each training batch, and of the held-out evaluation (avg@k).",
        ),
        panel(
            "Step rate",
            "suffix: steps/min",
            [
                (f"60 * {rate('gyre_trainer_step_duration_seconds_count')}", "trainer {{run_id}}"),
                (f"60 * {rate('gyre_orchestrator_batches_total')}", "orchestrator {{run_id}}"),
            ],
            "Steps trained and batches pushed per minute.",
            minimum=0,
        ),
        panel(
            "Step time",
            "s",
            [
                (mean_of("gyre_trainer_step_duration_seconds"), "trainer compute {{run_id}}"),
                (
                    f"max by (run_id) ({sel('gyre_orchestrator_batch_generation_seconds')})",
                    "batch generation {{run_id}}",
                ),
            ],
            "Trainer compute per step, and wall time to generate the last batch.",
            minimum=0,
        ),
        panel(
            "Async lag",
            STEPS,
            [
                (mean_of("gyre_orchestrator_policy_lag_steps"), "mean {{run_id}}"),
                (quantile(0.99, "gyre_orchestrator_policy_lag_steps"), "p99 {{run_id}}"),
                (
                    f"max by (run_id) ({sel('gyre_orchestrator_latest_weights_step')})"
                    f" - min by (run_id) ({sel('gyre_orchestrator_replica_policy_version')} >= 0)",
                    "slowest replica behind {{run_id}}",
                ),
                (f"max by (run_id) ({sel('gyre_orchestrator_max_async_level')})", "bound k {{run_id}}"),
            ],
            "Off-policy lag of trained samples ((step - 1) - oldest version that produced them), how many "
            "versions the slowest replica is behind the newest weights, and the configured bound k.",
            minimum=0,
        ),
        panel(
            "MFU",
            "percentunit",
            [(f"max by (run_id, rank) ({sel('gyre_trainer_mfu_ratio')})", "{{run_id}} rank {{rank}}")],
            "Model FLOPs utilisation of the last step per trainer rank (0-1).",
            minimum=0,
        ),
        panel(
            "Trainer tokens/s",
            TOKENS_PER_S,
            [
                (rate("gyre_trainer_tokens_total"), "per wall second {{run_id}}"),
                (
                    f"{rate('gyre_trainer_tokens_total')} / {rate('gyre_trainer_step_duration_seconds_sum')}",
                    "per compute second {{run_id}}",
                ),
            ],
            "Training throughput: per second of wall time (includes waiting for batches) and per second of compute.",
            minimum=0,
        ),
        panel(
            "Inference tokens/s",
            TOKENS_PER_S,
            [
                (rate("gyre_inference_generation_tokens_total"), "generated {{run_id}}"),
                (rate("gyre_inference_prompt_tokens_total"), "prompt {{run_id}}"),
            ],
            "Tokens generated and prompt tokens processed per second, all replicas.",
            minimum=0,
        ),
        panel(
            "Weight sync latency",
            "s",
            [
                (mean_of("gyre_trainer_weight_publish_seconds"), "trainer publish {{run_id}}"),
                (mean_of("gyre_orchestrator_weight_relay_duration_seconds"), "relay to all replicas {{run_id}}"),
                (mean_of("gyre_inference_weight_update_seconds"), "replica load {{run_id}}"),
            ],
            "Mean time to publish a weights version, to get every replica serving it (orchestrator's view), and "
            "for one replica to verify and load it.",
            minimum=0,
        ),
        panel(
            "Stale and dropped samples",
            "cps",
            [
                (rate("gyre_orchestrator_dropped_stale_samples_total"), "stale samples {{run_id}}"),
                (rate("gyre_orchestrator_dropped_zero_signal_groups_total"), "zero-signal groups {{run_id}}"),
                (rate("gyre_orchestrator_skipped_overlong_tasks_total"), "tasks too long for the context {{run_id}}"),
                (rate("gyre_orchestrator_rollouts_total", "run_id, outcome"), "rollouts {{outcome}} {{run_id}}"),
            ],
            "Samples dropped for exceeding the async bound, groups without advantage signal, tasks skipped because "
            "their prompt does not fit the model's context, and rollouts by outcome.",
            minimum=0,
        ),
    ]
    for p in panels:
        d = d.with_panel(p)
    d = d.with_row(db.Row("Rollouts and batches"))
    for p in [
        panel(
            "Rollout latency",
            "s",
            [
                (
                    quantile(q, "gyre_orchestrator_rollout_latency_seconds", "run_id, env"),
                    f"p{round(q * 100)} {{{{env}}}}",
                )
                for q in (0.5, 0.99)
            ],
            "Wall time of one rollout (model turns and environment replies) plus scoring, by environment.",
            width=6,
            minimum=0,
        ),
        panel(
            "Reward spread",
            "none",
            [(f"avg by (run_id, env) ({sel('gyre_orchestrator_reward_std')})", "std {{run_id}} {{env}}")],
            "Standard deviation of the rewards of each batch: no spread means no advantage signal.",
            width=6,
            minimum=0,
        ),
        panel(
            "Packing efficiency",
            "percentunit",
            [(f"max by (run_id) ({sel('gyre_orchestrator_packing_efficiency_ratio')})", "{{run_id}}")],
            "Tokens of the last batch / (rows x seq_len): the share of trainer compute spent on real tokens.",
            width=6,
            minimum=0,
        ),
        panel(
            "Batch throughput",
            "cps",
            [
                (rate("gyre_orchestrator_samples_total"), "samples/s {{run_id}}"),
                (rate("gyre_orchestrator_batch_tokens_total"), "tokens/s {{run_id}}"),
            ],
            "Samples and tokens pushed to the trainer per second.",
            width=6,
            minimum=0,
        ),
        panel(
            "Generation waste",
            "cps",
            [
                (rate("gyre_orchestrator_generated_completion_tokens_total"), "generated tokens/s {{run_id}}"),
                (rate("gyre_orchestrator_wasted_completion_tokens_total"), "wasted tokens/s {{run_id}}"),
                (rate("gyre_orchestrator_generated_groups_total"), "groups/s {{run_id}}"),
            ],
            "Completion tokens generated for batches, those that teach nothing (stale samples, zero-signal groups), "
            "and groups generated per second.",
            width=6,
            minimum=0,
        ),
        panel(
            "Judges, reward models, teacher",
            "cps",
            [
                # `or ... * 0`: a run without judges shows 0 rather than no data
                (
                    f"{rate('gyre_orchestrator_signal_calls_total', 'run_id, signal, outcome')}"
                    f" or max by (run_id) ({sel('gyre_orchestrator_step')}) * 0",
                    "{{signal}} {{outcome}} {{run_id}}",
                ),
                (
                    f"{rate('gyre_orchestrator_scoring_failures_total')}"
                    f" or max by (run_id) ({sel('gyre_orchestrator_step')}) * 0",
                    "scoring failures {{run_id}}",
                ),
                (
                    f"{rate('gyre_orchestrator_eval_scoring_failures_total')}"
                    f" or max by (run_id) ({sel('gyre_orchestrator_step')}) * 0",
                    "eval scoring failures {{run_id}}",
                ),
            ],  # fmt: skip
            "Calls per second to the models a run takes signals from, by outcome, and samples whose scoring "
            "failed after every retry (the same completion scored again), in training and in evals.",
            width=6,
            minimum=0,
        ),
        panel(
            "Redis memory",
            "bytes",
            [
                (
                    "max by (run_id) (" + sel("gyre_orchestrator_redis_memory_bytes", 'state="used"') + ")",
                    "used {{run_id}}",
                ),
                (
                    "max by (run_id) (" + sel("gyre_orchestrator_redis_memory_bytes", 'state="max"') + ")",
                    "maxmemory {{run_id}}",
                ),
            ],  # fmt: skip
            "Memory of the Redis holding the batch streams, and its maxmemory (0 = no limit): full, it refuses new "
            "batches (GyreRedisMemoryHigh warns at 80%).",
            width=6,
            minimum=0,
        ),
    ]:
        d = d.with_panel(p)
    d = d.with_row(db.Row("Learning health"))
    for p in learning_health():
        d = d.with_panel(p)
    return d


def learning_health() -> list[timeseries.Panel]:
    """One panel per learning-health alert (deploy/prometheus/alerts.yaml, group gyre-learning), drawn
    with the alert's own terms, so a firing alert can be read off its panel."""
    entropy, kl, ratio = sel("gyre_trainer_entropy"), sel("gyre_trainer_mismatch_kl"), sel("gyre_trainer_ratio_mean")
    truncated = sel("gyre_orchestrator_truncated_ratio")
    return [
        panel(
            "Entropy vs its peak",
            NATS,
            [
                (f"max by (run_id) ({entropy})", "entropy {{run_id}}"),
                (f"0.25 * max by (run_id) (max_over_time({entropy}[6h]))", "collapse line {{run_id}}"),
            ],
            "Mean token entropy of the policy and a quarter of its 6-hour peak: below that line for 10 minutes, "
            "GyreEntropyCollapse fires.",
            width=6,
            minimum=0,
        ),
        panel(
            "Mismatch KL drift",
            NATS,
            [
                (f"max by (run_id) (avg_over_time({kl}[10m]))", "10m mean {{run_id}}"),
                (f"3 * max by (run_id) (min_over_time({kl}[6h]))", "3x 6h low {{run_id}}"),
            ],
            "Trainer/inference KL of the sampled tokens (10-minute mean) and three times its 6-hour low: above "
            "both that line and 0.01 for 10 minutes, GyreMismatchKLRising fires.",
            width=6,
            minimum=0,
        ),
        panel(
            "Probability ratio off 1",
            "none",
            [
                (f"max by (run_id) ({ratio})", "last step {{run_id}}"),
                (f"max by (run_id) (avg_over_time({ratio}[10m]))", "10m mean {{run_id}}"),
            ],
            "Mean trainer/inference probability ratio π_θ/μ of the sampled tokens (last step and 10-minute mean); its "
            "expectation is 1: a 10-minute mean below 0.9 or above 1.1 for 10 minutes fires GyreMismatchRatioOff.",
            width=6,
        ),
        panel(
            "Response length",
            "suffix: tokens",
            [
                (
                    f"max by (run_id, env, stat) ({sel('gyre_orchestrator_response_length_tokens')})",
                    "{{stat}} {{run_id}} {{env}}",
                ),
            ],  # fmt: skip
            "Completion tokens per sample of each batch (mean and p95): a steady climb toward sampling.max_tokens "
            "precedes truncation.",
            width=6,
            minimum=0,
        ),
        panel(
            "Truncated samples",
            "percentunit",
            [
                (f"max by (run_id, env) ({truncated})", "last batch {{run_id}} {{env}}"),
                (f"max by (run_id, env) (avg_over_time({truncated}[15m]))", "15m mean {{run_id}} {{env}}"),
                (f"max by (run_id, env) ({sel('gyre_orchestrator_drift_ratio')})", "drift {{run_id}} {{env}}"),
            ],
            "Share of each batch's samples cut at the length limit: a 15-minute mean above 20% and twice the "
            "6 hours before fires GyreTruncationSpike. Drift: the share cut where a later turn's prompt no longer "
            "extended the sampled tokens (the chat template re-renders earlier turns; docs/environments.md).",
            width=6,
            minimum=0,
        ),
        panel(
            "Overlong shaping and filtering",
            "none",
            [
                # `or ... * 0`: both are off by default, and a run without them shows 0 rather than no data
                (
                    f"max by (run_id, env) ({sel('gyre_orchestrator_overlong_penalty_mean')})"
                    f" or max by (run_id) ({sel('gyre_orchestrator_step')}) * 0",
                    "mean penalty {{run_id}} {{env}}",
                ),
                (
                    f"{rate('gyre_orchestrator_masked_truncated_samples_total')}"
                    f" or max by (run_id) ({sel('gyre_orchestrator_step')}) * 0",
                    "left out of the loss /s {{run_id}}",
                ),
            ],  # fmt: skip
            "DAPO's length treatments (docs/orchestrator.md): the mean overlong penalty already in each batch's "
            "reward (advantage.overlong_buffer, <= 0), and samples cut at the length limit left out of the loss per "
            "second (advantage.mask_truncated).",
            width=6,
        ),
        panel(
            "Reward vs eval",
            "none",
            [
                (
                    f"avg by (run_id, env) (avg_over_time({sel('gyre_orchestrator_reward_mean')}[30m]))",
                    "train 30m mean {{run_id}} {{env}}",
                ),
                (
                    "avg by (run_id, env) (" + sel("gyre_orchestrator_eval_reward", 'stat="avg_at_k"') + ")",
                    "eval avg@k {{run_id}} {{env}}",
                ),
            ],  # fmt: skip
            "Training reward (30-minute mean) against the held-out eval: train up by 0.05 while eval is down by "
            "0.05 over 2 hours fires GyreRewardUpEvalDown (overfitting, reward hacking).",
            width=6,
        ),
        panel(
            "Reward by rubric component",
            "none",
            [
                (
                    f"avg by (run_id, env, function) ({sel('gyre_orchestrator_rubric_score_mean')})",
                    "{{function}} {{run_id}}",
                ),
            ],  # fmt: skip
            "Mean unweighted score of each rubric function per batch: which part of the reward moves.",
            width=6,
        ),
        panel(
            "Clipped tokens",
            "percentunit",
            [(f"max by (run_id) ({sel('gyre_trainer_clip_ratio')})", "{{run_id}}")],
            "Fraction of each step's loss tokens the objective clipped (or masked): rising with the mismatch KL, "
            "the updates run off-policy.",
            width=6,
            minimum=0,
        ),
        panel(
            "Gradient norm spikes",
            "none",
            [
                (f"max by (run_id) ({sel('gyre_trainer_grad_norm')})", "grad norm {{run_id}}"),
                (
                    f"sum by (run_id) (increase({sel('gyre_trainer_grad_norm_spikes_total')}[15m]))",
                    "spikes in 15m {{run_id}}",
                ),
            ],  # fmt: skip
            "Gradient norm and the steps the trainer judged non-finite or spiking (kept in debug/step_N for "
            "`gyre replay`): any fires GyreGradNormSpike.",
            width=6,
            minimum=0,
        ),
    ]
