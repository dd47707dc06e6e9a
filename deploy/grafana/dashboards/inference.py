"""The inference dashboard: per-replica latency, load, throughput, served policy version, weight
updates, the orchestrator's view of the replicas (rotation, demand) and the torch engine's counters."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from .panels import (
    TOKENS_PER_S,
    base,
    mean_of,
    panel,
    quantile,
    rate,
    rate_ratio,
    replica_gauge,
    replica_rate,
    sel,
)


def inference() -> db.Dashboard:
    d = base(
        "gyre-inference",
        "Gyre / Inference",
        "Inference replicas of one experiment: latency, load, throughput and served policy version. In a "
        "multi-run experiment every replica serves each run's adapter: requests, tokens, latency, served version "
        "and weight updates are per run; load and engine panels show the replicas serving the chosen runs.",
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
                (replica_gauge("sum", "gyre_inference_running_requests"), "running {{instance}}"),
                (replica_gauge("sum", "gyre_inference_waiting_requests"), "waiting {{instance}}"),
            ],
            "Sequences decoding now and queued for a batch slot, per replica (all runs it serves).",
            minimum=0,
        ),
        panel(
            "Tokens/s per replica",
            TOKENS_PER_S,
            [
                (rate("gyre_inference_generation_tokens_total", per), "generated {{run_id}} {{instance}}"),
                (rate("gyre_inference_prompt_tokens_total", per), "prompt {{run_id}} {{instance}}"),
            ],
            "Generation and prompt throughput of each replica.",
            minimum=0,
        ),
        panel(
            "Served policy version",
            "none",
            [
                (f"max by ({per}) ({sel('gyre_inference_policy_version')})", "{{run_id}} {{instance}}"),
                (f"max by (run_id) ({sel('gyre_orchestrator_latest_weights_step')})", "newest weights {{run_id}}"),
            ],
            "Weights version each replica serves (0 = base model; multi-run: each run's adapter), next to the "
            "newest published version.",
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
                    "{{run_id}} {{instance}}",
                )
            ],
            "Fraction of requests that ended with a server error, per replica (alert above 5%).",
            minimum=0,
        ),
        panel(
            "Weight update time",
            "s",
            [
                (mean_of("gyre_inference_weight_update_seconds", per), "mean {{run_id}} {{instance}}"),
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
            [(replica_rate("gyre_inference_engine_seconds_total", "instance, phase"), "{{phase}} {{instance}}")],
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
                    replica_rate("gyre_inference_engine_seconds_total", extra=f'phase="{phase}"')
                    + " / "
                    + replica_rate("gyre_inference_engine_decode_steps_total"),
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
                (replica_gauge("max", "gyre_inference_kv_cache_usage_ratio"), "KV cache in use {{instance}}"),
                (
                    replica_rate("gyre_inference_engine_prompt_tokens_total", extra='source="cached"')
                    + " / "
                    + replica_rate("gyre_inference_engine_prompt_tokens_total"),
                    "prompt tokens cached {{instance}}",
                ),
            ],
            "Torch backend: the fraction of KV cache blocks held by sequences, and of admitted prompt tokens whose "
            "keys and values came from the prefix cache or a group's first rollout instead of being computed.",
            minimum=0,
        ),
        panel(
            "Preemptions (KV cache full)",
            "cps",
            [(replica_rate("gyre_inference_engine_preemptions_total"), "{{instance}}")],
            "Torch backend: rows preempted per second for want of KV cache blocks; each is recomputed when "
            "readmitted. Above 0 for long: more rows in flight than the cache holds (engine.max_batch_size, "
            "the KV cache's size).",
            minimum=0,
        ),
    ]
    for p in panels:
        d = d.with_panel(p)
    return d
