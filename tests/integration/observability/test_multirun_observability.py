"""Multi-run observability: two runs sharing one trainer and one inference replica
(configs/multirun/two_runs.toml cut down), scraped by a real Prometheus (`gyre rl --prometheus`).

Trainer and orchestrator label their series with the run's name; the replica serves every run, so its
per-request and per-adapter series carry the run whose adapter a request named, and its replica-wide
series (load, engine, KV cache) are shown for the replicas serving the selected run. With one run
chosen in the `run_id` variable, every panel of every dashboard must show that run's data and no
other run's.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest
from gyre.local.prometheus import PROMETHEUS, LocalPrometheus
from observability_support import ROOT, dashboards, panel_queries, query_variables, substitute

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PROMETHEUS.exists(), reason="apt-get install prometheus"),
]

CONFIG = ROOT / "configs" / "multirun" / "two_runs.toml"
EXPERIMENT = "multirun"  # the config's run_id: the replica's own label
# enough steps for several 1 s scrapes of every per-step series (a step of this config takes well under 1 s)
RUNS = [{"name": "alpha", "max_steps": 24}, {"name": "beta", "max_steps": 16, "orchestrator": {"seed": 1}}]
RATE_INTERVAL = "20s"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("multirun-observability") / "run"
    cmd = [
        sys.executable, "-m", "gyre.cli", "rl", "@", str(CONFIG), "--output-dir", str(out), "--sft.enabled", "false",
        "--runs", json.dumps(RUNS), "--prometheus",
        "--orchestrator.eval.interval", "8", "--orchestrator.eval.num-examples", "4",
    ]  # fmt: skip
    start = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    with LocalPrometheus(out / "prometheus", {}, run_id=EXPERIMENT, rule_files=()) as prom:
        yield prom, start, time.time()


def finite(series: list[dict]) -> list[float]:
    return [float(v) for s in series for _, v in s["values"] if math.isfinite(float(v))]


def test_every_dashboard_lists_the_runs_and_shows_one_run_alone(run):
    prom, start, end = run
    failures = []
    for name, model in dashboards().items():
        found: dict[str, list[str]] = {}
        for var in query_variables(model):
            found[var.name] = prom.label_values(var.label, substitute(var.match, found, RATE_INTERVAL), start, end)
        assert {"alpha", "beta"} <= set(found["run_id"]), f"{name}: run_id offers {found['run_id']}"
    values = {"namespace": ["local"], "run_id": ["alpha"]}
    for q in panel_queries():
        series = prom.query_range(substitute(q.expr, values, RATE_INTERVAL), start, end, step=1)
        if not finite(series):
            failures.append(f"{q} -> {len(series)} series, no finite value")
        others = {s["metric"]["run_id"] for s in series if s["metric"].get("run_id", "alpha") != "alpha"}
        if others:
            failures.append(f"{q} -> series of {sorted(others)} with run_id=alpha chosen")
    assert not failures, "panels wrong for one run of a multi-run experiment:\n" + "\n".join(failures)


def test_inference_series_tell_the_runs_apart(run):
    prom, start, end = run
    sel = 'namespace="local"'
    served = prom.query_range(f"max by (run_id) (gyre_inference_policy_version{{{sel}}})", start, end, step=1)
    last = {s["metric"]["run_id"]: float(s["values"][-1][1]) for s in served}
    # each run's adapter reached its own last step; the base model itself stayed at version 0
    assert last == {EXPERIMENT: 0.0, "alpha": 24.0, "beta": 16.0}, last

    def most(expr: str) -> dict[str, float]:  # over the run (after it, the stopped services' series are stale)
        return {s["metric"]["run_id"]: max(finite([s])) for s in prom.query_range(expr, start, end, step=1)}

    tokens = most(f"sum by (run_id) (gyre_inference_generation_tokens_total{{{sel}}})")
    assert tokens.get("alpha", 0) > 0 and tokens.get("beta", 0) > 0, tokens
    done = most(f'sum by (run_id) (gyre_inference_weight_updates_total{{{sel}, outcome="success"}})')
    assert done.get("alpha", 0) >= 1 and done.get("beta", 0) >= 1, done
