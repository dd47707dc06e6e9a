"""Prometheus metrics of the trainer (`gyre_trainer_*`), served by rank 0 on `metrics.port`.

Gauges hold the last step's values; throughput is the `gyre_trainer_tokens_total` counter that
dashboards `rate()`; MFU is a 0..1 ratio per rank (rank 0 gathers the other ranks' values, so one
scrape target covers a whole torchrun job). Every series carries the `run_id` label so that
dashboards can template by experiment.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from gyre import metrics as m
from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

DEFAULT_PORT = 9101
# Duration buckets reach the slowest real case, so p99 stays a number instead of +Inf (docs/metrics.md,
# "Histogram buckets"): a 70B model's step can take many minutes; publishing gathers and writes its bf16
# weights (~140 GB), a checkpoint adds fp32 master weights and Adam state (~14 bytes a parameter, ~1 TB),
# which at a shared volume's ~250 MB/s takes over an hour.
STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600, 1200, 1800, 3600)
PUBLISH_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 900, 1200, 1800, 3600)
CHECKPOINT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 900, 1200, 1800, 2700, 3600, 5400, 7200, 10800)


class TrainerMetrics:
    """The trainer's metrics in their own registry (so tests can run several trainers in one process)."""

    def __init__(self, run_id: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.run_id = run_id
        r, label = self.registry, ("run_id",)
        self._families: list = []  # this run's metric families, for `forget`
        self._ranks: set[str] = set()

        def mine(family):
            self._families.append(family)
            return family.labels(run_id)

        def gauge(name: str, doc: str):
            return mine(m.gauge(name, doc, label, registry=r))

        def counter(name: str, doc: str):
            return mine(m.counter(name, doc, label, registry=r))

        def histogram(name: str, doc: str, buckets):
            return mine(m.histogram(name, doc, label, registry=r, buckets=buckets))

        self.step = gauge("gyre_trainer_step", "Last trained and published step.")
        self.loss = gauge("gyre_trainer_loss", "Loss of the last step.")
        self.entropy = gauge("gyre_trainer_entropy", "Mean token entropy of the policy in the last step (nats).")
        self.mismatch_kl = gauge("gyre_trainer_mismatch_kl", "KL between trainer and inference log-probs, last step.")
        # r = π_θ/μ of the sampled tokens over the last step's valid loss tokens: its mean is 1 in expectation
        # whatever the staleness, so a mean off 1 or a wild min/max is a mismatch the mean KL alone hides
        self.ratio_mean = gauge(
            "gyre_trainer_ratio_mean", "Mean trainer/inference probability ratio of the sampled tokens, last step."
        )
        self.ratio_min = gauge(
            "gyre_trainer_ratio_min", "Lowest trainer/inference probability ratio of a sampled token, last step."
        )
        self.ratio_max = gauge(
            "gyre_trainer_ratio_max", "Highest trainer/inference probability ratio of a sampled token, last step."
        )
        self.grad_norm = gauge("gyre_trainer_grad_norm", "Gradient norm before clipping, last step.")
        self.clip_ratio = gauge(
            "gyre_trainer_clip_ratio", "Fraction of the last step's loss tokens the objective clipped (or masked)."
        )
        self.grad_norm_spikes = counter(
            "gyre_trainer_grad_norm_spikes_total",
            "Steps whose gradient norm was non-finite or above debug.spike_factor x the recent median.",
        )
        self.skipped_updates = counter(
            "gyre_trainer_skipped_updates_total",
            "Steps whose optimizer update was skipped (a non-finite or zero gradient norm, no valid loss token); "
            "each still counts as trained.",
        )
        self.lr = gauge("gyre_trainer_lr", "Learning rate of the last step.")
        self.last_step_timestamp = gauge(
            "gyre_trainer_last_step_timestamp_seconds", "Unix time the last step was published."
        )
        self.tokens = counter("gyre_trainer_tokens_total", "Tokens trained on (all ranks).")
        self.rejected = counter("gyre_trainer_rejected_batches_total", "Batch entries sent to the dead-letter stream.")
        self._mfu = m.gauge(
            "gyre_trainer_mfu_ratio", "Model FLOPs utilisation (0..1) of the last step.", ("run_id", "rank"), registry=r
        )
        self.step_duration = histogram(
            "gyre_trainer_step_duration_seconds", "Wall time of one training step.", STEP_BUCKETS
        )
        self.publish_duration = histogram(
            "gyre_trainer_weight_publish_seconds", "Wall time to gather, write and publish one weights version.",
            PUBLISH_BUCKETS,
        )  # fmt: skip
        self.checkpoint_duration = histogram(
            "gyre_trainer_checkpoint_seconds", "Wall time to save one checkpoint.", CHECKPOINT_BUCKETS
        )

    def observe_step(self, record: dict[str, Any], mfu_per_rank: list[float]) -> None:
        """Update everything from one step's event record (see docs/architecture.md, Event logs)."""
        self.step.set(record["step"])
        for gauge, key in (
            (self.loss, "loss"),
            (self.entropy, "entropy"),
            (self.mismatch_kl, "mismatch_kl"),
            (self.ratio_mean, "ratio_mean"),
            (self.ratio_min, "ratio_min"),
            (self.ratio_max, "ratio_max"),
            (self.grad_norm, "grad_norm"),
            (self.lr, "lr"),
        ):
            if record.get(key) is not None:
                gauge.set(record[key])
        clipped = record.get("clip_frac", record.get("masked_frac"))  # the objective's (docs/algorithms.md)
        if clipped is not None:
            self.clip_ratio.set(clipped)
        if record.get("skipped"):  # a step without signal or with a broken gradient: nothing was learned from it
            self.skipped_updates.inc()
        self.tokens.inc(record["num_tokens"])
        self.step_duration.observe(record["step_seconds"])
        for rank, mfu in enumerate(mfu_per_rank):
            self._mfu.labels(self.run_id, str(rank)).set(mfu)
            self._ranks.add(str(rank))
        self.last_step_timestamp.set(record.get("time", time.time()))

    def forget(self) -> None:
        """Remove this run's series from the shared registry (multi-run: a finished run's series go, so a
        long-lived trainer's /metrics does not grow with every run it ever trained)."""
        for family in self._families:
            with contextlib.suppress(KeyError):
                family.remove(self.run_id)
        for rank in self._ranks:
            with contextlib.suppress(KeyError):
                self._mfu.remove(self.run_id, rank)


def serve(registry: CollectorRegistry, port: int | None, host: str) -> tuple[Any, int]:
    """Start /metrics of `registry` (every run's `TrainerMetrics`) on `port` (unset: 9101; 0: a free port);
    returns (server, actual port), logged."""
    server, actual = m.start_metrics_server(DEFAULT_PORT if port is None else port, registry, host=host)
    log.info("metrics on http://%s:%d/metrics", host, actual)
    return server, actual
