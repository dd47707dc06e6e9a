"""A run made to collapse fires the learning-health alerts in a real Prometheus scraping the real services.

`gyre rl --prometheus` on the tiny model with a learning rate of 0.05 (configs/ci.toml otherwise, lr 1e-3):
within ~20 steps the policy's entropy falls from 6.9 nats to under 1, a quarter of its start, while the
trainer/inference mismatch KL stays around 1 (the trainer's policy runs away from the one inference samples
with, a step behind). The launcher's Prometheus starts before the services (so it scrapes the first steps
too: a step takes ~0.1 s here) and scrapes them every second. It evaluates the shipped `gyre-learning`
rules with one change: `for:` is 0s, so a run of seconds can show them firing (the `for:` durations
themselves are promtool-tested in deploy/prometheus/alerts_test.yaml); the child swaps that rule file in
for the bundled one before the launcher starts. The run has no useful end and is stopped as soon as both
alerts fire.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from gyre.local.prometheus import PROMETHEUS
from observability_support import ALERTS, ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PROMETHEUS.exists(), reason="apt-get install prometheus"),
]

RUN_ID = "ci"  # configs/ci.toml
EXPECTED = {"GyreEntropyCollapse", "GyreMismatchKLRising"}
# `gyre rl` with the launcher's Prometheus loading argv[1] instead of deploy/prometheus/alerts.yaml
LAUNCH = """
import sys
from pathlib import Path

import gyre.local.prometheus as prometheus

prometheus.bundled_rule_files = lambda: [Path(sys.argv[1])]
from gyre.cli import main

sys.exit(main(["rl", *sys.argv[2:]]))
"""


def learning_rules(path: Path) -> Path:
    """The shipped `gyre-learning` group with every `for:` set to 0s."""
    (group,) = [g for g in yaml.safe_load(ALERTS.read_text())["groups"] if g["name"] == "gyre-learning"]
    for rule in group["rules"]:
        rule["for"] = "0s"
    path.write_text(yaml.safe_dump({"groups": [group]}))
    return path


def firing(prometheus_url: str) -> list[dict]:
    query = urllib.parse.urlencode({"query": 'ALERTS{alertstate="firing"}'})
    with urllib.request.urlopen(f"{prometheus_url}/api/v1/query?{query}", timeout=10) as response:
        return [r["metric"] for r in json.loads(response.read())["data"]["result"]]


def test_a_collapsing_run_fires_entropy_collapse_and_mismatch_drift(tmp_path):
    rules = learning_rules(tmp_path / "learning.yaml")
    cmd = [sys.executable, "-c", LAUNCH, str(rules), "@", str(ROOT / "configs" / "ci.toml"),
           "--output-dir", str(tmp_path / "run"), "--prometheus", "--max-steps", "100000",
           "--trainer.optim.lr", "0.05"]  # fmt: skip
    console = tmp_path / "console.log"
    deadline = time.monotonic() + 420
    fired: dict[str, dict] = {}
    with open(console, "w") as log:
        run = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            url = None
            while not fired.keys() >= EXPECTED and run.poll() is None and time.monotonic() < deadline:
                found = re.search(r"prometheus: (http://127\.0\.0\.1:\d+)", console.read_text(errors="replace"))
                url = url or (found and found[1])
                if url:
                    with contextlib.suppress(OSError):
                        for alert in firing(url):
                            fired.setdefault(alert["alertname"], alert)
                time.sleep(1)
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGTERM)
                run.wait(60)
    text = console.read_text(errors="replace")
    assert str(rules) in (tmp_path / "run" / "prometheus" / "prometheus.yml").read_text()  # our rules were loaded
    assert fired.keys() >= EXPECTED, f"fired {sorted(fired)}\n{text[-3000:]}"
    for name in EXPECTED:
        labels = fired[name]
        assert (labels["run_id"], labels["namespace"], labels["severity"]) == (RUN_ID, "local", "warning"), labels
