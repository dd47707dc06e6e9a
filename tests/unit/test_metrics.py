"""Metric naming conventions, get-or-create helpers, and the /metrics endpoint (parsed, promtool-checked)."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

import pytest
from gyre.metrics import check_metric_name, counter, gauge, histogram, start_metrics_server
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families


@pytest.mark.parametrize(
    "name, kind, labels",
    [
        ("gyre_trainer_tokens_total", "counter", ("run_id",)),
        ("gyre_inference_requests_total", "counter", ("run_id", "status")),
        ("gyre_orchestrator_reward_mean", "gauge", ()),
        ("gyre_trainer_mfu_ratio", "gauge", ()),
        ("gyre_weight_relay_seconds", "histogram", ("replica",)),
    ],
)
def test_good_names_pass(name, kind, labels):
    check_metric_name(name, kind, labels)


@pytest.mark.parametrize(
    "name, kind, labels, message",
    [
        ("trainer_tokens_total", "counter", (), "gyre_"),
        ("gyre_Trainer_tokens_total", "counter", (), "snake"),
        ("gyre_trainer:tokens_total", "counter", (), "colons"),
        ("gyre_trainer__tokens_total", "counter", (), "snake"),
        ("gyre_trainer_tokens", "counter", (), "end with _total"),
        ("gyre_trainer_tokens_total", "gauge", (), "only counters"),
        ("gyre_step_ms", "histogram", (), "base units"),
        ("gyre_step_milliseconds", "gauge", (), "base units"),
        ("gyre_gpu_percent", "gauge", (), "_ratio"),
        ("gyre_latency_bucket", "gauge", (), "reserved"),
        ("gyre_latency_seconds", "histogram", ("le",), "reserved"),
        ("gyre_requests_total", "counter", ("Status",), "label"),
        ("gyre_requests_total", "counter", ("a", "a"), "duplicate"),
        ("gyre_requests_total", "summary", (), "kind"),
    ],
)
def test_bad_names_fail(name, kind, labels, message):
    with pytest.raises(ValueError, match=message):
        check_metric_name(name, kind, labels)


def test_helpers_are_get_or_create_per_registry():
    registry = CollectorRegistry()
    a = counter("gyre_test_things_total", "things", ["run_id"], registry=registry)
    assert counter("gyre_test_things_total", "things", ["run_id"], registry=registry) is a
    assert counter("gyre_test_things_total", "things", ["run_id"], registry=CollectorRegistry()) is not a
    with pytest.raises(ValueError, match="already exists as counter with labels"):
        counter("gyre_test_things_total", "things", ["other"], registry=registry)
    histogram("gyre_test_step_seconds", "step time", registry=registry)
    with pytest.raises(ValueError, match="already exists as histogram"):
        gauge("gyre_test_step_seconds", "step time", registry=registry)
    with pytest.raises(ValueError, match="description"):
        gauge("gyre_test_no_doc", "", registry=registry)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


@pytest.fixture
def registry_with_metrics():
    registry = CollectorRegistry()
    tokens = counter("gyre_test_tokens_total", "Tokens trained.", ["run_id"], registry=registry)
    tokens.labels(run_id="r1").inc(128)
    gauge("gyre_test_policy_version", "Policy version served.", ["run_id"], registry=registry).labels("r1").set(3)
    latency = histogram("gyre_test_step_seconds", "Step time.", registry=registry, buckets=(0.1, 1, 10))
    latency.observe(0.5)
    latency.observe(2)
    return registry


def test_server_exposes_parseable_metrics_with_conventional_names(registry_with_metrics):
    server, port = start_metrics_server(0, registry_with_metrics, host="127.0.0.1")
    try:
        assert port > 0
        families = {f.name: f for f in text_string_to_metric_families(scrape(port))}
    finally:
        server.shutdown()
        server.server_close()
    tokens = families["gyre_test_tokens"]  # the parser strips _total from the family name
    assert tokens.type == "counter"
    (sample,) = [s for s in tokens.samples if s.name == "gyre_test_tokens_total"]
    assert sample.value == 128 and sample.labels == {"run_id": "r1"}
    assert families["gyre_test_policy_version"].samples[0].value == 3
    step_samples = families["gyre_test_step_seconds"].samples
    buckets = {s.labels["le"]: s.value for s in step_samples if s.name.endswith("_bucket")}
    assert buckets == {"0.1": 0, "1.0": 1, "10.0": 2, "+Inf": 2}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_accepts_the_exposition(registry_with_metrics):
    text = generate_latest(registry_with_metrics)
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
    assert result.stdout.strip() == b"" and result.stderr.strip() == b"", (result.stdout + result.stderr).decode()
