"""`gyre_inference_*` Prometheus metrics of one server (own registry, so tests can run several servers).

Every series carries `run_id`: the run a request or weight update is for (multi-run: the run whose named
adapter it names, else the replica's own `run_id`); replica-wide series (load, engine) carry the replica's
own, and the served version is one series per run (the model's, and each named adapter's). Adapter names
are the runs' (bounded by the experiment), and a request naming no served model is counted under the
replica's own. The only other labels are `endpoint` (chat, completions, responses, generate, classify) and `outcome`
(requests: success, client_error (4xx), aborted (the client went away), unavailable (503: loading or
shutting down), server_error (5xx); weight updates: success, error), so
cardinality stays bounded whatever clients send. Running/waiting/version gauges are read from the
backend at scrape time, never pushed.

Series (see docs/inference.md for how dashboards use them):
- gyre_inference_requests_total{run_id, endpoint, outcome}            counter
- gyre_inference_prompt_tokens_total{run_id}                           counter
- gyre_inference_generation_tokens_total{run_id}                       counter
- gyre_inference_time_to_first_token_seconds{run_id}                   histogram (first token of the first choice)
- gyre_inference_request_latency_seconds{run_id, endpoint}             histogram (arrival -> last byte)
- gyre_inference_running_requests{run_id}                              gauge (sequences decoding; one per choice)
- gyre_inference_waiting_requests{run_id}                              gauge (sequences queued)
- gyre_inference_policy_version{run_id}                                gauge (weights version served)
- gyre_inference_weight_update_seconds{run_id}                         histogram (verify + load + swap)
- gyre_inference_weight_updates_total{run_id, outcome}                 counter
Torch backend only (read from its `EngineStats` at scrape time, engine_stats.py):
- gyre_inference_engine_seconds_total{run_id, phase}                   counter (decode, device, prefill, capture, swap)
- gyre_inference_engine_decode_steps_total{run_id}                     counter
- gyre_inference_engine_prompt_tokens_total{run_id, source}            counter (computed, cached: the prefix cache)
- gyre_inference_engine_preemptions_total{run_id}                      counter
- gyre_inference_kv_cache_usage_ratio{run_id}                          gauge (blocks held by sequences)
"""

from __future__ import annotations

import contextlib

from gyre.metrics import counter, counter_function, gauge, gauge_function, histogram
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gyre_inference.backend import Backend

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# up to the orchestrator's request timeout (inference.timeout_s, 300 s): a request queued behind full batches waits
# minutes for its first token, and a top bucket below that would cap every quantile at it
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# a replica loading a large model's weights (~140 GB in bf16 for 70B) from the shared volume takes many minutes
UPDATE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 900, 1200, 1800, 3600)
# the OpenAI routes, the tokens-in route (/inference/v1/generate) and a reward model's /classify
ENDPOINTS = ("chat", "completions", "responses", "generate", "classify")
OUTCOMES = ("success", "client_error", "aborted", "unavailable", "server_error")
PHASES = ("decode", "device", "prefill", "capture", "swap")  # EngineStats.<phase>_seconds


class InferenceMetrics:
    content_type = CONTENT_TYPE_LATEST  # text exposition 0.0.4 (what `promtool check metrics` reads)

    def __init__(self, run_id: str, backend: Backend):
        self.registry = CollectorRegistry()
        r, run = self.registry, {"run_id": run_id}
        self._requests = counter(
            "gyre_inference_requests_total",
            "Completion requests by endpoint and outcome.",
            ["run_id", "endpoint", "outcome"],
            r,
        )
        # per run (`run_of`): .labels(run)
        self.prompt_tokens = counter("gyre_inference_prompt_tokens_total", "Prompt tokens processed.", ["run_id"], r)
        self.generation_tokens = counter(
            "gyre_inference_generation_tokens_total", "Tokens generated (all choices).", ["run_id"], r
        )
        self.time_to_first_token = histogram(
            "gyre_inference_time_to_first_token_seconds",
            "Request arrival to the first generated token.",
            ["run_id"],
            r,
            buckets=TTFT_BUCKETS,
        )
        self._latency = histogram(
            "gyre_inference_request_latency_seconds",
            "Request arrival to the last token of the response.",
            ["run_id", "endpoint"],
            r,
            buckets=LATENCY_BUCKETS,
        )
        gauge("gyre_inference_running_requests", "Sequences decoding now (one per choice).", ["run_id"], r).labels(
            **run
        ).set_function(lambda: backend.load_stats()[0])
        gauge("gyre_inference_waiting_requests", "Sequences queued for a batch slot.", ["run_id"], r).labels(
            **run
        ).set_function(lambda: backend.load_stats()[1])
        gauge_function(
            "gyre_inference_policy_version",
            "Weights version served (0 = base model): the model's, and each named adapter's under its run.",
            ["run_id"],
            r,
            lambda: self._served_versions(backend),
        )
        self.weight_update_seconds = histogram(
            "gyre_inference_weight_update_seconds",
            "UpdateWeights/ReloadWeights duration: verify, load and swap.",
            ["run_id"],
            r,
            buckets=UPDATE_BUCKETS,
        )
        self._updates = counter(
            "gyre_inference_weight_updates_total", "Weight updates by outcome.", ["run_id", "outcome"], r
        )
        self.run_id = run_id
        self._runs: set[str] = set()
        self._expose(run_id)
        self._engine_series(r, backend)

    def _engine_series(self, r: CollectorRegistry, backend: Backend) -> None:
        """The torch engine's own counters, read from an `EngineStats` snapshot at scrape time (no samples for a
        backend that keeps none)."""
        counters = [
            ("gyre_inference_engine_seconds_total", ["phase"], "Torch engine time by phase: decode steps (wall), "
             "their device part, prefills, CUDA graph captures, weight swaps.",
             lambda s: {(phase,): getattr(s, f"{phase}_seconds") for phase in PHASES}),
            ("gyre_inference_engine_decode_steps_total", [], "Torch engine decode steps.",
             lambda s: {(): s.decode_steps}),
            ("gyre_inference_engine_prompt_tokens_total", ["source"], "Prompt tokens the torch engine admitted, by "
             "where their keys and values came from: computed, or cached (prefix cache, a group's first rollout).",
             lambda s: {("computed",): s.prefilled, ("cached",): s.admitted_tokens - s.prefilled}),
            ("gyre_inference_engine_preemptions_total", [], "Torch engine rows preempted for want of KV cache blocks "
             "(recomputed when readmitted; vLLM's num_preemptions).", lambda s: {(): s.preemptions}),
        ]  # fmt: skip

        def reader(samples):
            def read() -> dict[tuple, float]:
                stats = backend.engine_stats()
                return {} if stats is None else {(self.run_id, *key): v for key, v in samples(stats).items()}

            return read

        for name, labels, doc, samples in counters:
            counter_function(name, doc, ["run_id", *labels], r, reader(samples))
        gauge("gyre_inference_kv_cache_usage_ratio", "Fraction of the torch engine's KV cache blocks held by "
              "sequences.", ["run_id"], r).labels(self.run_id).set_function(
            lambda: stats.kv_cache_usage if (stats := backend.engine_stats()) is not None else 0.0
        )  # fmt: skip

    def run_of(self, adapter: str | None) -> str:
        """The `run_id` of a request or weight update for `adapter`: multi-run serves each run's adapter under the
        run's name, so a run's series are told apart from the others' (None: the replica's model itself). A run
        seen for the first time gets its zeros exposed."""
        run = self.run_id if adapter is None else adapter
        self._expose(run)
        return run

    def _served_versions(self, backend: Backend) -> dict[tuple, float]:
        versions = {(self.run_id,): float(backend.version)}
        for name in backend.adapter_names:
            with contextlib.suppress(KeyError):  # forgotten since it was listed
                versions[(name,)] = float(backend.adapter_version(name))
        return versions

    def _expose(self, run: str) -> None:
        """Zeros of every series of `run` (the replica's own from the start, a run's at its first request or
        update), so rate() and the error ratios have data from the first scrape on."""
        if run in self._runs:
            return
        self._runs.add(run)
        for endpoint in ENDPOINTS:
            self._latency.labels(run, endpoint)
            for outcome in OUTCOMES:
                self._requests.labels(run, endpoint, outcome)
        for outcome in ("success", "error"):
            self._updates.labels(run, outcome)
        for family in (self.prompt_tokens, self.generation_tokens, self.time_to_first_token):
            family.labels(run)
        self.weight_update_seconds.labels(run)

    def request_done(self, endpoint: str, outcome: str, seconds: float | None = None, run: str | None = None) -> None:
        run = run or self.run_id
        self._expose(run)
        self._requests.labels(run, endpoint, outcome).inc()
        if seconds is not None:
            self._latency.labels(run, endpoint).observe(seconds)

    def weight_update_done(self, ok: bool, seconds: float, adapter: str | None = None) -> None:
        run = self.run_of(adapter)
        self._updates.labels(run, "success" if ok else "error").inc()
        if ok:
            self.weight_update_seconds.labels(run).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
