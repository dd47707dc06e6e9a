"""The trainer dashboard: objective and optimiser gauges, utilisation, and where each step's wall
time goes (compute, weight publishing, checkpointing, waiting for batches)."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import timeseries

from .panels import NATS, RATE, TOKENS_PER_S, base, panel, quantile, rate, rate_ratio, sel

LAST_STEP = sel("gyre_trainer_last_step_timestamp_seconds")


def trainer() -> db.Dashboard:
    d = base(
        "gyre-trainer",
        "Gyre / Trainer",
        "The trainer of one experiment: objective, optimiser, utilisation and where each step's time goes.",
        "gyre_trainer_step",
    )
    steps = rate("gyre_trainer_step_duration_seconds_count")

    def gauge(title: str, metric: str, unit: str, description: str) -> timeseries.Panel:
        return panel(title, unit, [(f"max by (run_id) ({sel(metric)})", "{{run_id}}")], description)

    panels = [
        gauge("Loss", "gyre_trainer_loss", "none", "Loss of the last step."),
        gauge("Entropy", "gyre_trainer_entropy", NATS, "Mean token entropy of the policy in the last step."),
        gauge(
            "Mismatch KL",
            "gyre_trainer_mismatch_kl",
            NATS,
            "KL between the trainer's and the inference engine's log-probs of the sampled tokens.",
        ),
        panel(
            "Trainer/inference probability ratio",
            "none",
            [
                (f"max by (run_id) ({sel(f'gyre_trainer_ratio_{stat}')})", f"{stat} {{{{run_id}}}}")
                for stat in ("mean", "min", "max")
            ],
            "r = π_θ/μ of the sampled tokens over the last step's valid loss tokens: mean, lowest and highest. "
            "The mean stays near 1 in a sound run (its expectation is 1 when sampling from the full distribution); "
            "a mean off 1 means trainer and inference disagree (another temperature, dtype or model, or a very "
            "stale policy). The min and max show the few tokens the mean KL hides.",
            minimum=0,
        ),
        gauge("Grad norm", "gyre_trainer_grad_norm", "none", "Gradient norm before clipping, last step."),
        gauge(
            "Clipped tokens",
            "gyre_trainer_clip_ratio",
            "percentunit",
            "Fraction of the last step's loss tokens the objective clipped (or masked).",
        ),
        panel(
            "Gradient norm spikes, skipped updates",
            "short",
            [
                (
                    f"sum by (run_id) (increase({sel('gyre_trainer_grad_norm_spikes_total')}[{RATE}]))",
                    "spikes {{run_id}}",
                ),
                (
                    f"sum by (run_id) (increase({sel('gyre_trainer_skipped_updates_total')}[{RATE}]))",
                    "skipped {{run_id}}",
                ),
            ],
            "Steps with a non-finite or spiking gradient norm, kept in debug/step_N for `gyre replay`; steps whose "
            "update was skipped (non-finite or zero gradient, no valid loss token: nothing learned from them).",
            minimum=0,
        ),
        gauge("Learning rate", "gyre_trainer_lr", "sci", "Learning rate of the last step."),
        panel(
            "MFU",
            "percentunit",
            [(f"max by (run_id, rank) ({sel('gyre_trainer_mfu_ratio')})", "{{run_id}} rank {{rank}}")],
            "Model FLOPs utilisation of the last step per rank (0-1).",
            minimum=0,
        ),
        panel(
            "Step time breakdown",
            "s",
            [
                (f"{rate('gyre_trainer_step_duration_seconds_sum')} / {steps}", "compute {{run_id}}"),
                (f"{rate('gyre_trainer_weight_publish_seconds_sum')} / {steps}", "publish weights {{run_id}}"),
                (f"{rate('gyre_trainer_checkpoint_seconds_sum')} / {steps}", "checkpoint {{run_id}}"),
                (
                    f"clamp_min((1 - {rate('gyre_trainer_step_duration_seconds_sum')}"
                    f" - {rate('gyre_trainer_weight_publish_seconds_sum')}"
                    f" - {rate('gyre_trainer_checkpoint_seconds_sum')}) / {steps}, 0)",
                    "waiting for batch and other {{run_id}}",
                ),
            ],
            "Wall seconds per step, stacked: compute (forward, backward, optimizer), weight publishing, "
            "checkpointing, and the rest (mostly waiting for the next batch; in multi-run also the other runs' "
            "steps, which share the trainer).",
            minimum=0,
            stacked=True,
        ),
        panel(
            "Step duration quantiles",
            "s",
            [
                (quantile(q, "gyre_trainer_step_duration_seconds"), f"p{round(q * 100)} {{{{run_id}}}}")
                for q in (0.5, 0.99)
            ],
            "Compute time of one training step.",
            minimum=0,
        ),
        panel(
            "Weight publish duration quantiles",
            "s",
            [
                (quantile(q, "gyre_trainer_weight_publish_seconds"), f"p{round(q * 100)} {{{{run_id}}}}")
                for q in (0.5, 0.99)
            ],
            "Time to gather, write and publish one weights version (buckets up to 1 h: a large model's publish "
            "takes many minutes). Checkpoint time per step is in the step time breakdown.",
            minimum=0,
        ),
        panel(
            "Tokens/s",
            TOKENS_PER_S,
            [
                (rate("gyre_trainer_tokens_total"), "wall {{run_id}}"),
                # the step records' tokens_per_second: tokens over the steps' own compute time
                (
                    rate_ratio("gyre_trainer_tokens_total", "gyre_trainer_step_duration_seconds_sum"),
                    "compute {{run_id}}",
                ),
            ],
            "Tokens trained per second (all ranks): of wall time, and of the steps' compute time (the step record's "
            "`tokens_per_second`; the gap is time spent publishing, checkpointing and waiting for batches).",
            minimum=0,
        ),
        panel(
            "Time since last step",
            "s",
            # the last value of the past 6 hours: a trainer that is down (no longer scraped) keeps counting up
            # instead of leaving the panel empty when it matters most
            [(f"time() - max by (run_id) (last_over_time({LAST_STEP}[6h]) > 0)", "{{run_id}}")],
            "Seconds since the last step was published, counting on while the trainer is down (alerts: "
            "GyreTrainerStalled after 15 minutes without a step, GyreTrainerAbsent when it is not scraped).",
            minimum=0,
        ),
        panel(
            "Rejected batches",
            "short",
            [
                (f"sum by (run_id) (increase({sel('gyre_trainer_rejected_batches_total')}[{RATE}]))", "{{run_id}}"),
                # the orchestrator reads the dead-letter stream: the newest entries held, the older ones trimmed
                (f"max by (run_id, state) ({sel('gyre_orchestrator_dead_letters')})", "dead {{state}} {{run_id}}"),
            ],
            "Batch entries sent to the dead-letter stream, and the dead letters in it: `held` (the newest 16, kept "
            "for inspection) and `trimmed` (dropped to bound Redis memory, in all).",
            minimum=0,
        ),
    ]
    for p in panels:
        d = d.with_panel(p)
    return d
