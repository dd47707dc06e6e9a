"""docs/metrics.md against the services' real metrics: same names, types and labels; units that match the
name; every exposition clean under `promtool check metrics`."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from observability_support import (
    CATALOGUE,
    PROMTOOL,
    catalogue,
    declared,
    exposition_families,
    service_registries,
)
from prometheus_client import generate_latest

PREFIX = {"trainer": "gyre_trainer_", "orchestrator": "gyre_orchestrator_", "inference": "gyre_inference_"}


@pytest.fixture(scope="module")
def registries():
    return service_registries()


def test_catalogue_lists_exactly_the_metrics_the_services_create(registries):
    rows = catalogue()
    live = {name: spec for registry in registries.values() for name, spec in declared(registry).items()}
    assert live, "no service metrics found"
    missing = sorted(set(live) - set(rows))
    stale = sorted(set(rows) - set(live))
    hints = [f"| `{n}` | {live[n][0]} | ? | {', '.join(f'`{x}`' for x in live[n][1])} | ? |" for n in missing]
    assert not missing, f"metrics not in {CATALOGUE}; add rows:\n" + "\n".join(hints)
    assert not stale, f"{CATALOGUE} lists metrics no service creates: {stale}"
    for name, (kind, labels) in live.items():
        row = rows[name]
        assert row.kind == kind, f"{name}: catalogue says {row.kind}, code creates a {kind}"
        assert row.labels == labels, f"{name}: catalogue labels {row.labels}, code {labels}"


def test_each_service_exports_only_its_own_prefix_and_nothing_outside_gyre_metrics(registries):
    for service, registry in registries.items():
        exposed = exposition_families(generate_latest(registry).decode())
        made = declared(registry)
        # every family in the exposition was created through gyre.metrics (which enforces the conventions)
        assert set(exposed) == set(made), f"{service}: {sorted(set(exposed) ^ set(made))}"
        assert all(name.startswith(PREFIX[service]) for name in exposed), service
        assert all(exposed[name] == made[name][0] for name in exposed), service


def test_units_and_meanings_follow_the_conventions():
    for name, row in catalogue().items():
        assert row.meaning and row.meaning != "?", f"{name}: no meaning"
        assert "run_id" in row.labels, f"{name}: every series must carry run_id"
        stem = name.removesuffix("_total")
        if stem.endswith("_seconds"):
            assert row.unit.startswith("seconds"), f"{name}: unit {row.unit!r} but the name says seconds"
        elif stem.endswith("_ratio"):
            assert row.unit == "ratio", f"{name}: unit {row.unit!r} but the name says ratio (0-1)"
        else:
            assert not row.unit.startswith(("seconds", "ratio")), f"{name}: unit {row.unit!r} needs the name's suffix"
        assert (row.kind == "counter") == name.endswith("_total"), f"{name}: _total only and always on counters"


def test_request_histograms_reach_the_timeout_that_bounds_them(registries):
    """A time above a histogram's top finite bucket only counts in +Inf, and every quantile above it reads as that
    bucket: the request histograms reach the orchestrator's request timeout, weight updates its UpdateWeights
    deadline (TTFT stopped at 30 s: a request queued for minutes showed a p99 of 30 s)."""
    from gyre.config.orchestrator import OrchestratorConfig

    inference = OrchestratorConfig().inference
    text = generate_latest(registries["inference"]).decode()

    def top(histogram: str) -> float:
        bounds = [float(line.split('le="')[1].split('"')[0]) for line in text.splitlines()
                  if line.startswith(f"{histogram}_bucket{{") and '+Inf' not in line]  # fmt: skip
        assert bounds, histogram
        return max(bounds)

    for histogram in ("gyre_inference_time_to_first_token_seconds", "gyre_inference_request_latency_seconds"):
        assert top(histogram) >= inference.timeout_s, histogram
    assert top("gyre_inference_weight_update_seconds") >= OrchestratorConfig().relay.timeout_s


@pytest.mark.skipif(not Path(PROMTOOL).exists(), reason="apt-get install prometheus")
def test_promtool_check_metrics_is_clean_on_every_service(registries):
    for service, registry in registries.items():
        text = generate_latest(registry)
        result = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=60)
        assert result.returncode == 0 and not result.stdout.strip(), (
            f"{service}: {result.stdout.decode()}{result.stderr.decode()}"
        )


def test_catalogue_parser_sees_a_changed_row(tmp_path):
    """The comparison above can fail: a relabelled row in a copy of the page is read back as such."""
    text = CATALOGUE.read_text().replace("| `run_id`, `rank` |", "| `run_id` |")
    copy = tmp_path / "metrics.md"
    copy.write_text(text)
    assert catalogue(copy)["gyre_trainer_mfu_ratio"].labels == ("run_id",)
    assert catalogue()["gyre_trainer_mfu_ratio"].labels == ("run_id", "rank")
