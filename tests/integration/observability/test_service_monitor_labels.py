"""What a Prometheus the Prometheus operator configures from the chart's ServiceMonitors stores: every label a Gyre
service exports keeps its name and value, next to the labels the scrape adds.

The operator gives each target `namespace`, `service`, `pod`, `container`, `endpoint` (the ServiceMonitor port's
name) and `job`; with `honorLabels` off (its default) a scraped label of one of those names is renamed
`exported_<name>` and the target's value takes its place. Gyre's inference metrics carry `endpoint` (`chat`,
`completions`, ...), so in a cluster every such series read `endpoint="metrics"`: the inference dashboard's
latency by endpoint was one line named `metrics` (`gyre rl --prometheus` honours the services' labels, so no
local run showed it). Here a real Prometheus scrapes, as the operator would configure it from each rendered
ServiceMonitor, an exposition holding every catalogued metric with every label it documents.
"""

from __future__ import annotations

import http.server
import threading
from contextlib import ExitStack

import helm_python
import pytest
import yaml
from gyre.local import prometheus as local_prometheus
from gyre.local.prometheus import PROMETHEUS, LocalPrometheus
from observability_support import CHART, catalogue

pytestmark = pytest.mark.skipif(not PROMETHEUS.exists(), reason="apt-get install prometheus")

NAMESPACE = "rl"
# the metric prefix each ServiceMonitor's Service serves (a `servers` entry runs `gyre inference`)
PREFIX = {"inference": "gyre_inference_", "orchestrator": "gyre_orchestrator_", "trainer": "gyre_trainer_"}
RELABEL_KEYS = {"sourceLabels": "source_labels", "targetLabel": "target_label"}


def rendered_objects() -> list[dict]:
    """A release with every ServiceMonitor (a server's too) and KEDA's ScaledObject."""
    values = {
        "monitoring": {"enabled": True},
        "assumeApiVersions": ["monitoring.coreos.com/v1", "keda.sh/v1alpha1"],
        "servers": [{"name": "judge", "model": "/data/model"}],
        "inference": {"autoscaling": {"enabled": True}},
    }
    with helm_python.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="exp", namespace=NAMESPACE, is_install=True)
    return [d for path, text in rendered.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def exposition(prefix: str) -> str:
    """One sample of every catalogued metric of a service, each documented label set to `svc-<label>`."""
    lines = []
    for name, row in sorted(catalogue().items()):
        if name.startswith(prefix):
            labels = ",".join(f'{label}="svc-{label}"' for label in row.labels)
            lines.append(f"{name}{{{labels}}} 1")
    assert lines, prefix
    return "\n".join(lines) + "\n"


def serve(text: str, stack: ExitStack) -> str:
    """An HTTP server answering `text` on every path; its host:port."""
    body = text.encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stack.callback(server.server_close)
    stack.callback(server.shutdown)
    return f"127.0.0.1:{server.server_address[1]}"


def relabel(rule: dict) -> dict:
    """A ServiceMonitor relabeling (camelCase) as a Prometheus relabel_config."""
    out = {RELABEL_KEYS.get(k, k): v for k, v in rule.items()}
    if "action" in out:
        out["action"] = out["action"].lower()
    return out


def scrape_config(monitor: dict, address: str) -> list[dict]:
    """The scrape jobs the operator generates for a ServiceMonitor whose Service selects one pod at `address`."""
    service = monitor["metadata"]["name"]  # each ServiceMonitor is named as the one Service it selects
    jobs = []
    for i, endpoint in enumerate(monitor["spec"]["endpoints"]):
        target_labels = {
            "namespace": NAMESPACE,
            "service": service,
            "pod": f"{service}-0",
            "container": "main",
            "endpoint": endpoint["port"],
            "job": service,
        }
        jobs.append(
            {
                "job_name": f"serviceMonitor/{NAMESPACE}/{service}/{i}",
                "honor_labels": endpoint.get("honorLabels", False),
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "metrics_path": endpoint.get("path", "/metrics"),
                "static_configs": [{"targets": [address], "labels": target_labels}],
                "relabel_configs": [relabel(r) for r in endpoint.get("relabelings", [])],
                "metric_relabel_configs": [relabel(r) for r in endpoint.get("metricRelabelings", [])],
            }
        )
    return jobs


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """(every gyre_ series, the ScaledObject's demand query's result, {Service: its metric prefix}) of a Prometheus
    configured from the release."""
    docs = rendered_objects()
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert len(monitors) == 4, [d["metadata"]["name"] for d in monitors]
    (scaler,) = [d for d in docs if d["kind"] == "ScaledObject"]
    (trigger,) = scaler["spec"]["triggers"]
    with ExitStack() as stack, pytest.MonkeyPatch.context() as monkeypatch:
        jobs, targets, expected = [], {}, {}
        for monitor in monitors:
            component = monitor["metadata"]["labels"]["app.kubernetes.io/component"]
            prefix = PREFIX["inference" if component.startswith("server-") else component]
            address = serve(exposition(prefix), stack)
            jobs += scrape_config(monitor, address)
            targets[component] = [address]
            expected[monitor["metadata"]["name"]] = prefix
        config = {"global": {"scrape_interval": "1s"}, "scrape_configs": jobs}
        # LocalPrometheus writes what render_config returns: here the operator's jobs instead of gyre rl's
        monkeypatch.setattr(local_prometheus, "render_config", lambda *a, **k: yaml.safe_dump(config))
        with LocalPrometheus(tmp_path_factory.mktemp("prom"), targets, run_id="unused", rule_files=()) as prom:
            prom.wait_for_targets()
            return prom.query('{__name__=~"gyre_.+"}'), prom.query(trigger["metadata"]["query"]), expected


def test_every_exported_label_survives_the_service_monitors_scrape(scraped):
    series, _, expected = scraped
    rows = catalogue()
    problems = []
    seen = set()
    for sample in series:
        labels = dict(sample["metric"])
        name = labels.pop("__name__")
        seen.add((labels["service"], name))
        exported = {k: v for k, v in labels.items() if k in rows[name].labels}
        wanted = {label: f"svc-{label}" for label in rows[name].labels}
        if exported != wanted:
            problems.append(f"{labels['service']} {name}: exported labels {wanted} stored as {exported}")
        if renamed := sorted(k for k in labels if k.startswith("exported_")):
            problems.append(f"{labels['service']} {name}: labels renamed by the scrape {renamed}")
        if labels.get("gyre_release") != "exp" or labels.get("namespace") != NAMESPACE or "pod" not in labels:
            problems.append(f"{labels['service']} {name}: target labels missing in {labels}")
    assert not problems, "\n".join(problems)
    missing = {(svc, n) for svc, prefix in expected.items() for n in rows if n.startswith(prefix)} - seen
    assert not missing, f"series not stored: {sorted(missing)}"


def test_the_autoscalers_query_reads_the_orchestrators_demand_as_scraped(scraped):
    """KEDA's query selects the orchestrator's gyre_orchestrator_model_requests by the labels the ServiceMonitor
    adds (`namespace`, `gyre_release`): it returns the demand (here the one sample of 1 served), never nothing."""
    _, demand, _ = scraped
    assert [float(s["value"][1]) for s in demand] == [1.0], demand
