"""A run made to collapse fires the learning-health alerts in a real Prometheus scraping the real services.

`gyre rl` on the tiny model with a learning rate of 0.5 (configs/ci.toml otherwise): within a few steps
the policy's entropy falls from ~6.9 nats to under 1 and the trainer/inference mismatch KL jumps from 0
to > 1 (the trainer's policy runs away from the one inference sampled with). A real Prometheus scrapes
the three services every second and evaluates the shipped `gyre-learning` rules, with one change: `for:`
is 0s, so a run of a minute can show them firing (the `for:` durations themselves are promtool-tested in
deploy/prometheus/alerts_test.yaml). The run is stopped as soon as both alerts fire.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml
from gyre.local.prometheus import PROMETHEUS, LocalPrometheus
from observability_support import ALERTS, ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PROMETHEUS.exists(), reason="apt-get install prometheus"),
]

RUN_ID = "ci"  # configs/ci.toml
EXPECTED = {"GyreEntropyCollapse", "GyreMismatchKLRising"}
TARGETS = {"inference": ("inference.toml", "server"), "trainer": ("trainer.toml", "metrics"),
           "orchestrator": ("orchestrator.toml", "metrics")}  # fmt: skip


def learning_rules(path: Path) -> Path:
    """The shipped `gyre-learning` group with every `for:` set to 0s."""
    (group,) = [g for g in yaml.safe_load(ALERTS.read_text())["groups"] if g["name"] == "gyre-learning"]
    for rule in group["rules"]:
        rule["for"] = "0s"
    path.write_text(yaml.safe_dump({"groups": [group]}))
    return path


def service_targets(out: Path, deadline: float) -> dict[str, list[str]]:
    """The services' metrics addresses, from the configs the launcher writes before starting them."""
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, KeyError, tomllib.TOMLDecodeError):
            return {
                job: [f"127.0.0.1:{tomllib.loads((out / 'configs' / name).read_text())[section]['port']}"]
                for job, (name, section) in TARGETS.items()
            }
        time.sleep(0.2)
    raise TimeoutError("the launcher wrote no service configs")


def test_a_collapsing_run_fires_entropy_collapse_and_mismatch_drift(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gyre.cli", "rl", "@", str(ROOT / "configs" / "ci.toml"), "--output-dir", str(out),
           "--max-steps", "40", "--trainer.optim.lr", "0.5"]  # fmt: skip
    deadline = time.monotonic() + 420
    fired: dict[str, dict] = {}
    with open(tmp_path / "console.log", "w") as log:
        run = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            targets = service_targets(out, deadline)
            rules = learning_rules(tmp_path / "learning.yaml")
            with LocalPrometheus(tmp_path / "prometheus", targets, run_id=RUN_ID, rule_files=[rules]) as prom:
                while fired.keys() < EXPECTED and run.poll() is None and time.monotonic() < deadline:
                    for alert in prom.query('ALERTS{alertstate="firing"}'):
                        fired.setdefault(alert["metric"]["alertname"], alert["metric"])
                    time.sleep(1)
                entropy = prom.query(f'gyre_trainer_entropy{{run_id="{RUN_ID}"}}')
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGTERM)
                run.wait(60)
    console = (tmp_path / "console.log").read_text(errors="replace")[-3000:]
    assert fired.keys() >= EXPECTED, f"fired {sorted(fired)}; entropy now {entropy}\n{console}"
    for name in EXPECTED:
        labels = fired[name]
        assert (labels["run_id"], labels["namespace"], labels["severity"]) == (RUN_ID, "local", "warning"), labels
