"""LocalPrometheus against a real exporter (prometheus_client) and Debian's real prometheus server."""

from __future__ import annotations

import os
import time

import pytest
from gyre.local.prometheus import PROMETHEUS, LocalPrometheus, PrometheusError, render_config
from gyre.metrics import counter, gauge, start_metrics_server
from prometheus_client import CollectorRegistry

pytestmark = pytest.mark.skipif(not PROMETHEUS.exists(), reason="apt-get install prometheus")


@pytest.fixture
def exporter():
    """A tiny /metrics server: one counter that keeps growing and one gauge, both with run_id."""
    registry = CollectorRegistry()
    tokens = counter("gyre_test_tokens_total", "Tokens.", ["run_id"], registry=registry).labels("exp-a")
    tokens.inc(100)
    gauge("gyre_test_step", "Step.", ["run_id"], registry=registry).labels("exp-a").set(7)
    gauge("gyre_test_unlabelled", "No run_id of its own.", registry=registry).set(1)
    server, port = start_metrics_server(0, registry, host="127.0.0.1")
    yield f"127.0.0.1:{port}", tokens
    server.shutdown()
    server.server_close()


def wait_for(fn, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"condition not met within {timeout}s")


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_scrapes_labels_queries_and_reopens_history(tmp_path, exporter):
    address, tokens = exporter
    rules = tmp_path / "rules.yaml"
    rules.write_text("groups:\n- name: t\n  rules:\n  - alert: TestStepLow\n    expr: gyre_test_step < 10\n")
    targets = {"trainer": [address], "empty": []}
    prom = LocalPrometheus(tmp_path / "prom", targets, run_id="local-run", rule_files=[rules])
    with prom:
        pid = prom.proc.pid
        assert prom.url.startswith("http://127.0.0.1:")
        prom.wait_for_targets(timeout=30)
        series = wait_for(lambda: prom.query("gyre_test_step"))
        assert len(series) == 1
        labels = series[0]["metric"]
        # target labels added for the dashboards' template variables; the exporter's own run_id wins
        assert labels["component"] == "trainer" and labels["namespace"] == "local" and labels["job"] == "trainer"
        assert labels["run_id"] == "exp-a" and "exported_run_id" not in labels
        assert float(series[0]["value"][1]) == 7
        # a series without its own run_id gets the launcher's
        assert prom.query("gyre_test_unlabelled")[0]["metric"]["run_id"] == "local-run"
        # rate() of a counter that grows between scrapes is positive
        tokens.inc(1000)
        rate = wait_for(
            lambda: [s for s in prom.query("rate(gyre_test_tokens_total[10s])") if float(s["value"][1]) > 0]
        )
        assert rate[0]["metric"]["run_id"] == "exp-a"
        assert float(prom.query("1 + 1")[0]["value"][1]) == 2
        with pytest.raises(PrometheusError, match="bad_data"):
            prom.query("rate(gyre_test_tokens_total[")
        rule = wait_for(lambda: [r for r in prom.rules() if r["name"] == "TestStepLow" and r["state"] != "inactive"])
        assert rule[0]["health"] == "ok" and rule[0]["state"] in ("pending", "firing")
        scraped_until = time.time()
    assert prom.proc is None and not process_alive(pid)
    with pytest.raises(PrometheusError, match="not started"):
        _ = prom.url

    # the TSDB survives: a new server with no targets answers range queries over the past
    with LocalPrometheus(tmp_path / "prom", {}, run_id="local-run") as reopened:
        past = reopened.query_range("gyre_test_step", start=scraped_until - 20, end=scraped_until, step=1)
        assert past and all(float(v) == 7 for _, v in past[0]["values"])
        assert reopened.targets_health() == {}


def test_config_lists_only_jobs_with_targets_and_resolves_rule_paths(tmp_path):
    import json

    config = json.loads(render_config({"a": ["h:1", "h:2"], "b": []}, "r", "5s", [tmp_path / "x.yaml"]))
    assert [j["job_name"] for j in config["scrape_configs"]] == ["a"]
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["h:1", "h:2"]
    assert config["global"]["scrape_interval"] == "5s"
    assert config["rule_files"] == [str((tmp_path / "x.yaml").resolve())]


def test_missing_binary_and_bad_config_fail_clearly(tmp_path):
    with pytest.raises(PrometheusError, match="apt-get install"):
        LocalPrometheus(tmp_path / "a", {}, run_id="r", binary=tmp_path / "nope").start()
    bad_rules = tmp_path / "bad.yaml"
    bad_rules.write_text("groups:\n- name: t\n  rules:\n  - alert: X\n    expr: 'rate(('\n")
    prom = LocalPrometheus(tmp_path / "b", {}, run_id="r", rule_files=[bad_rules], startup_timeout=20)
    with pytest.raises(PrometheusError, match="did not become ready") as err:
        prom.start()
    assert "bad.yaml" in str(err.value)  # the log tail names the broken file
    assert prom.proc is None
    assert not [p for p in os.listdir("/proc") if p.isdigit() and "b/prometheus.yml" in _cmdline(p)]


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
