"""Gyre's Grafana dashboards as code (grafana-foundation-sdk) -> charts/gyre/dashboards/*.json.

    .venv/bin/python deploy/grafana/build_dashboards.py           # write the JSON files
    .venv/bin/python deploy/grafana/build_dashboards.py --check   # exit 1 if they are stale

The chart ships every ``charts/gyre/dashboards/*.json`` as a ConfigMap for the Grafana sidecar.
Three dashboards: the experiment overview, inference, trainer. Every query is filtered by the
``namespace`` and ``run_id`` template variables and every panel has a unit; the metric names are the
services' real ones (docs/metrics.md). tests/integration/observability proves that every query returns
data from a real Prometheus scraping a real `gyre rl` run, and that the JSON files are up to date.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.builders.common import ReduceDataOptions, StackingConfig, VizLegendOptions
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    BigValueColorMode,
    BigValueGraphMode,
    LegendDisplayMode,
    LegendPlacement,
    StackingMode,
)
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    VariableRefresh,
    VariableSort,
)

ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = ROOT / "charts" / "gyre" / "dashboards"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
# Every query filters on the experiment; `run_id` is exported by the services themselves and
# `namespace` is added by the scrape (kube-prometheus-stack, or LocalPrometheus's "local").
RUN = 'namespace=~"$namespace", run_id=~"$run_id"'
RATE = "$__rate_interval"
TAGS = ["gyre"]

# Units (Grafana unit ids; "suffix:" makes a custom one).
TOKENS_PER_S = "suffix: tok/s"
STEPS = "suffix: steps"
NATS = "suffix: nats"


def sel(metric: str, extra: str = "") -> str:
    """`metric{namespace=~"$namespace", run_id=~"$run_id"[, extra]}`."""
    return f"{metric}{{{RUN}{', ' + extra if extra else ''}}}"


def rate(metric: str, by: str = "run_id", extra: str = "") -> str:
    return f"sum by ({by}) (rate({sel(metric, extra)}[{RATE}]))"


def rate_ratio(numerator: str, denominator: str, by: str = "run_id", extra: str = "") -> str:
    """rate(numerator{extra}) / rate(denominator), both summed by `by` (a share, or a mean per event)."""
    return f"{rate(numerator, by, extra)} / {rate(denominator, by)}"


def mean_of(histogram: str, by: str = "run_id") -> str:
    """Mean of a histogram's observations over the rate window."""
    return f"{rate(histogram + '_sum', by)} / {rate(histogram + '_count', by)}"


def quantile(q: float, histogram: str, by: str = "run_id", extra: str = "") -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({sel(histogram + '_bucket', extra)}[{RATE}])))"


def query(expr: str, legend: str, ref: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).range()


def panel(
    title: str,
    unit: str,
    queries: list[tuple[str, str]],
    description: str,
    *,
    width: int = 8,
    height: int = 8,
    minimum: float | None = None,
    stacked: bool = False,
) -> timeseries.Panel:
    """A time-series panel; `queries` are (PromQL, legend) pairs."""
    p = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(height)
        .fill_opacity(10 if not stacked else 40)
        .legend(
            VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)
        )
    )
    if minimum is not None:
        p = p.min(minimum)
    if stacked:
        p = p.stacking(StackingConfig().mode(StackingMode.NORMAL))
    for i, (expr, legend) in enumerate(queries):
        p = p.with_target(query(expr, legend, chr(ord("A") + i)))
    return p


def stat_panel(title: str, unit: str, expr: str, description: str, width: int = 4) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(4)
        .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .graph_mode(BigValueGraphMode.AREA)
        .color_mode(BigValueColorMode.VALUE)
        .with_target(query(expr, "{{run_id}}", "A"))
    )


def variables(anchor_metric: str) -> list:
    """datasource, namespace and run_id variables; `anchor_metric` is exported by every experiment."""
    datasource = db.DatasourceVariable("datasource").id("datasource").label("Data source").type("prometheus")
    namespace = (
        db.QueryVariable("namespace")
        .id("namespace")
        .label("Namespace")
        .datasource(DATASOURCE)
        .query(f"label_values({anchor_metric}, namespace)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
    )
    run_id = (
        db.QueryVariable("run_id")
        .id("run_id")
        .label("Experiment")
        .datasource(DATASOURCE)
        .query(f'label_values({anchor_metric}{{namespace=~"$namespace"}}, run_id)')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )
    return [datasource, namespace, run_id]


def base(uid: str, title: str, description: str, anchor_metric: str) -> db.Dashboard:
    return (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .variables(variables(anchor_metric))
        .link(
            db.DashboardLink("Gyre dashboards")
            .type(DashboardLinkType.DASHBOARDS)
            .tags(TAGS)
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
    )


# ---- experiment overview -------------------------------------------------------------------------
def overview() -> db.Dashboard:
    d = base(
        "gyre-overview",
        "Gyre / Experiment overview",
        "One RL experiment at a glance: reward, speed, async lag, utilisation and weight sync.",
        "gyre_trainer_step",
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
                (rate("gyre_orchestrator_rollouts_total", "run_id, outcome"), "rollouts {{outcome}} {{run_id}}"),
            ],
            "Samples dropped for exceeding the async bound, groups without advantage signal, and rollouts by outcome.",
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
            ],  # fmt: skip
            "Calls per second to the models a run takes signals from, by outcome, and samples whose scoring "
            "failed after every retry (generated and scored again).",
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
    entropy, kl = sel("gyre_trainer_entropy"), sel("gyre_trainer_mismatch_kl")
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
            ],
            "Share of each batch's samples cut at the length limit: a 15-minute mean above 20% and twice the "
            "6 hours before fires GyreTruncationSpike.",
            width=6,
            minimum=0,
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


# ---- inference --------------------------------------------------------------------------------------
def inference() -> db.Dashboard:
    d = base(
        "gyre-inference",
        "Gyre / Inference",
        "Inference replicas of one experiment: latency, load, throughput and served policy version.",
        "gyre_inference_policy_version",
    )
    per = "run_id, instance"
    ttft = "gyre_inference_time_to_first_token_seconds"
    latency = "gyre_inference_request_latency_seconds"
    panels = [
        panel(
            "Time to first token",
            "s",
            [(quantile(q, ttft), f"p{round(q * 100)} {{{{run_id}}}}") for q in (0.5, 0.9, 0.99)],
            "Request arrival to the first generated token, quantiles over all replicas.",
            minimum=0,
        ),
        panel(
            "Request latency",
            "s",
            [
                (quantile(q, latency, "run_id, endpoint"), f"p{round(q * 100)} {{{{endpoint}}}} {{{{run_id}}}}")
                for q in (0.5, 0.99)
            ],
            "Request arrival to the last token of the response, by endpoint.",
            minimum=0,
        ),
        panel(
            "Requests/s by outcome",
            "reqps",
            [(rate("gyre_inference_requests_total", "run_id, outcome"), "{{outcome}} {{run_id}}")],
            "Completion requests per second: success, client_error, aborted, server_error.",
            minimum=0,
        ),
        panel(
            "Running and waiting sequences",
            "short",
            [
                (f"sum by ({per}) ({sel('gyre_inference_running_requests')})", "running {{instance}}"),
                (f"sum by ({per}) ({sel('gyre_inference_waiting_requests')})", "waiting {{instance}}"),
            ],
            "Sequences decoding now and queued for a batch slot, per replica.",
            minimum=0,
        ),
        panel(
            "Tokens/s per replica",
            TOKENS_PER_S,
            [
                (rate("gyre_inference_generation_tokens_total", per), "generated {{instance}}"),
                (rate("gyre_inference_prompt_tokens_total", per), "prompt {{instance}}"),
            ],
            "Generation and prompt throughput of each replica.",
            minimum=0,
        ),
        panel(
            "Served policy version",
            "none",
            [
                (f"max by ({per}) ({sel('gyre_inference_policy_version')})", "{{instance}}"),
                (f"max by (run_id) ({sel('gyre_orchestrator_latest_weights_step')})", "newest weights {{run_id}}"),
            ],
            "Weights version each replica serves (0 = base model), next to the newest published version.",
            minimum=0,
        ),
        panel(
            "Server error ratio",
            "percentunit",
            [
                (
                    rate_ratio(
                        "gyre_inference_requests_total", "gyre_inference_requests_total", per, 'outcome="server_error"'
                    ),
                    "{{instance}}",
                )
            ],
            "Fraction of requests that ended with a server error, per replica (alert above 5%).",
            minimum=0,
        ),
        panel(
            "Weight update time",
            "s",
            [
                (mean_of("gyre_inference_weight_update_seconds", per), "mean {{instance}}"),
                (quantile(0.99, "gyre_inference_weight_update_seconds"), "p99 {{run_id}}"),
            ],
            "UpdateWeights/ReloadWeights: verify, load and swap a weights version.",
            minimum=0,
        ),
        panel(
            "Weight updates/s by outcome",
            "cps",
            [(rate("gyre_inference_weight_updates_total", "run_id, outcome"), "{{outcome}} {{run_id}}")],
            "Weight updates per second, success or error.",
            minimum=0,
        ),
        panel(
            "Replicas in rotation",
            "short",
            [
                (f"sum by (run_id) ({sel('gyre_orchestrator_replica_up')})", "in rotation {{run_id}}"),
                (f"count by (run_id) ({sel('gyre_orchestrator_replica_up')})", "known {{run_id}}"),
            ],
            "Inference replicas the orchestrator sends work to, out of those it knows.",
            minimum=0,
        ),
        panel(
            "Demand on the replicas",
            "short",
            [
                (f"sum by (run_id, state) ({sel('gyre_orchestrator_model_requests')})", "{{state}} {{run_id}}"),
                (f"count by (run_id) ({sel('gyre_orchestrator_replica_up')})", "replicas {{run_id}}"),
            ],
            "Model requests the orchestrator has outstanding, in flight or queued for a slot or a replica: what "
            "inference.autoscaling scales the replicas on (replicas = ceil(demand / targetRequestsPerReplica)).",
            minimum=0,
        ),
        panel(
            "UpdateWeights calls by result",
            "cps",
            [(rate("gyre_orchestrator_weight_relay_calls_total", "run_id, result"), "{{result}} {{run_id}}")],
            "The orchestrator's UpdateWeights calls to replicas per second, by result.",
            minimum=0,
        ),
        # the torch engine's own counters (its log line, docs/inference.md "Engine log line")
        panel(
            "Engine time by phase",
            "percentunit",
            [(rate("gyre_inference_engine_seconds_total", f"{per}, phase"), "{{phase}} {{instance}}")],
            "Torch backend: the share of wall time each replica's engine spent in decode steps (device: the part "
            "inside their kernels; the rest is host work the device waited for), prefills, CUDA graph captures "
            "and weight swaps.",
            minimum=0,
        ),
        panel(
            "Decode step time",
            "s",
            [
                (
                    rate_ratio(
                        "gyre_inference_engine_seconds_total",
                        "gyre_inference_engine_decode_steps_total",
                        per,
                        f'phase="{phase}"',
                    ),
                    f"{phase} {{{{instance}}}}",
                )
                for phase in ("decode", "device")
            ],
            "Torch backend: mean wall time of one decode step of the whole batch, and its device part.",
            minimum=0,
        ),
        panel(
            "KV cache and prefix cache",
            "percentunit",
            [
                (f"max by ({per}) ({sel('gyre_inference_kv_cache_usage_ratio')})", "KV cache in use {{instance}}"),
                (
                    rate_ratio(
                        "gyre_inference_engine_prompt_tokens_total",
                        "gyre_inference_engine_prompt_tokens_total",
                        per,
                        'source="cached"',
                    ),
                    "prompt tokens cached {{instance}}",
                ),
            ],
            "Torch backend: the fraction of KV cache blocks held by sequences, and of admitted prompt tokens whose "
            "keys and values came from the prefix cache or a group's first rollout instead of being computed.",
            minimum=0,
        ),
    ]
    for p in panels:
        d = d.with_panel(p)
    return d


# ---- trainer -----------------------------------------------------------------------------------------
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
        gauge("Grad norm", "gyre_trainer_grad_norm", "none", "Gradient norm before clipping, last step."),
        gauge(
            "Clipped tokens",
            "gyre_trainer_clip_ratio",
            "percentunit",
            "Fraction of the last step's loss tokens the objective clipped (or masked).",
        ),
        panel(
            "Gradient norm spikes",
            "short",
            [(f"sum by (run_id) (increase({sel('gyre_trainer_grad_norm_spikes_total')}[{RATE}]))", "{{run_id}}")],
            "Steps with a non-finite or spiking gradient norm, kept in debug/step_N for `gyre replay`.",
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
            "checkpointing, and the rest (mostly waiting for the next batch).",
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
            "Tokens/s",
            TOKENS_PER_S,
            [(rate("gyre_trainer_tokens_total"), "{{run_id}}")],
            "Tokens trained per second of wall time (all ranks).",
            minimum=0,
        ),
        panel(
            "Time since last step",
            "s",
            [(f"time() - max by (run_id) ({sel('gyre_trainer_last_step_timestamp_seconds')} > 0)", "{{run_id}}")],
            "Seconds since the last step was published (alert: no step for 15 minutes).",
            minimum=0,
        ),
        panel(
            "Rejected batches",
            "short",
            [(f"sum by (run_id) (increase({sel('gyre_trainer_rejected_batches_total')}[{RATE}]))", "{{run_id}}")],
            "Batch entries sent to the dead-letter stream.",
            minimum=0,
        ),
    ]
    for p in panels:
        d = d.with_panel(p)
    return d


DASHBOARDS = {"overview.json": overview, "inference.json": inference, "trainer.json": trainer}


def to_json(dashboard: db.Dashboard) -> dict:
    """The dashboard as plain JSON, panels numbered 1.. in layout order (links and viewPanel need ids)."""
    model = json.loads(json.dumps(dashboard.build(), cls=JSONEncoder))
    for i, p in enumerate(model["panels"], start=1):
        p["id"] = i
    return model


def render() -> dict[str, str]:
    """{file name: dashboard JSON text}."""
    return {name: json.dumps(to_json(make()), indent=2, sort_keys=True) + "\n" for name, make in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Exit 1 if the files differ from the code.")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR, help="Where to write (default: the chart).")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = args.out_dir / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        print(f"stale dashboards (run {Path(__file__).relative_to(ROOT)}): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
